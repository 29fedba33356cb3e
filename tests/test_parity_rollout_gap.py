"""portrl parity rollout (portrl/parity/rollout_gap.py): the hf engine's log-probs against the trainer's forward on
the CPU, within the published bound and near the committed CPU golden; the verdict rule."""

import json
import math

import pytest

from portrl.device import get_backend
from portrl.parity.rollout_gap import GAP_KEYS, gap_verdict, golden_path, run_rollout_gap
from portrl.parity.tolerances import ROLLOUT_GAP


def test_hf_engine_on_the_cpu_is_within_the_bound_and_near_its_golden(tmp_path, monkeypatch):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    report = run_rollout_gap(get_backend("cpu"), ["hf"], ("float32",), work_dir=tmp_path)
    (case,) = report["cases"]
    assert report["verdict"] == case["verdict"] == "pass" and case["engine"] == "hf"
    golden = json.loads(golden_path().read_text())["hf-float32"]
    assert case["cpu_golden"] == golden
    for key in GAP_KEYS:  # the same run on another CPU differs in rounding only: within a decade of the golden
        assert 0 < case[key] < 10 * golden[key] + 1e-12, key
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]  # the runs' folder is gone


@pytest.mark.parametrize("factor, verdict", [(0.5, "pass"), (1.0, "pass"), (5.0, "warn"), (20.0, "fail"),
                                             (math.nan, "fail")])
def test_verdict_by_the_dtypes_bound(factor, verdict):
    bound = ROLLOUT_GAP["bfloat16"]["training/rollout_log_probs_diff_max"]
    gap = {"training/rollout_log_probs_diff_mean": 0.0, "training/rollout_log_probs_diff_max": factor * bound}
    assert gap_verdict("cpu", "bfloat16", gap) == verdict
