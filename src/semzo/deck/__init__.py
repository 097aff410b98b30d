"""Input decks: TOML read into immutable, validated objects, one per section. The schema is in
:mod:`.sections`, reading and validation in :mod:`.read`; this package's names are the deck's
public interface."""

from .read import build, check_world, from_toml_text, load, parse_override
from .sections import (
    SECTIONS,
    STAGES,
    CheckpointSection,
    ClusterSection,
    CorpusSection,
    Deck,
    DeckError,
    EmbedSection,
    ExperimentSection,
    ModelSection,
    PlaceSection,
    PromptSection,
    RunSection,
    TopologySection,
    TrainSection,
    ZoSection,
)

__all__ = ["SECTIONS", "STAGES", "CheckpointSection", "ClusterSection", "CorpusSection", "Deck",
           "DeckError", "EmbedSection", "ExperimentSection", "ModelSection", "PlaceSection",
           "PromptSection", "RunSection", "TopologySection", "TrainSection", "ZoSection", "build",
           "check_world", "from_toml_text", "load", "parse_override"]
