"""Per-rank step metrics: the JSONL format, its readers, a summary, a plot and a progress bar.

Each rank writes ``metrics_rank{r}.jsonl`` in the run folder with a ``MetricsWriter``;
``read_run`` merges them, ``summarize`` and ``plot_run`` report on the result, and
``TrainingProgress`` shows the run live on rank 0.
"""

from colossal_hetero.metrics.plot import plot_run
from colossal_hetero.metrics.progress import TrainingProgress, format_status
from colossal_hetero.metrics.records import (
    MetricsWriter,
    StepRecord,
    rank_metrics_path,
    read_metrics,
    read_run,
)
from colossal_hetero.metrics.summary import summarize

__all__ = [
    "MetricsWriter",
    "StepRecord",
    "TrainingProgress",
    "format_status",
    "plot_run",
    "rank_metrics_path",
    "read_metrics",
    "read_run",
    "summarize",
]
