"""`semzo experiment`: semantic vs random sharding x ZO modes x seeds at one forward-pass
budget, and its Markdown report with plots (see runner.py and report.py)."""

from .report import write_report
from .runner import run_experiment

__all__ = ["run_experiment", "write_report"]
