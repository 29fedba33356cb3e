"""Cross-hardware parity: op and algorithm cases against a float64 reference, goldens and their replay,
the end-to-end envelope, and the cross-backend matrix. Thresholds: :mod:`portrl.parity.tolerances`."""

from portrl.parity.compare import compare_files, compare_reports
from portrl.parity.golden import record_golden, replay_golden
from portrl.parity.logprob_rank import first_divergence, rank_check
from portrl.parity.metrics import compare_outputs, compare_tensors
from portrl.parity.runner import run_ops_parity
from portrl.parity.tolerances import TOLERANCES, tolerance

__all__ = [
    "TOLERANCES", "compare_files", "compare_outputs", "compare_reports", "compare_tensors", "first_divergence",
    "rank_check", "record_golden", "replay_golden", "run_ops_parity", "tolerance",
]
