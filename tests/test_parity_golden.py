"""Replay of the committed CPU golden (tests/goldens/cpu), a tampered golden failing, padded vs packed forward.

1 vs 2 data-parallel workers is tests/test_distributed_ray.py::test_two_ray_workers_match_one_worker;
HF vs vLLM log-probs run in the vllm test group (ci/vllm_tests.sh); their comparison function is
tested in tests/test_parity_metrics.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from portrl.device import get_backend
from portrl.parity.golden import read_golden, replay_golden
from portrl.parity.metrics import compare_tensors

GOLDEN = Path(__file__).parent / "goldens" / "cpu"


def test_committed_golden_is_small_and_complete():
    meta, batch, expected = read_golden(GOLDEN)
    size = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert size < 2_000_000
    assert meta["recorded_on"]["backend"] == "cpu" and meta["dtype"] == "float32"
    assert {"input_ids", "attention_mask", "response_mask", "token_level_rewards"} <= set(batch)
    assert {"old_log_probs", "advantages", "weight_sum", "update_norm"} <= set(expected)
    assert meta["grad_norm"] > 0 and expected["advantages"].abs().sum() > 0  # the step really moves the model
    assert batch["response_mask"].sum(1).min() >= 1


def test_replay_on_cpu_passes():
    report = replay_golden(GOLDEN, get_backend("cpu"))
    assert report["verdict"] == "pass", {k: v for k, v in report["checks"].items() if v["verdict"] != "pass"}
    assert set(report["checks"]) >= {"old_log_probs", "entropy", "advantages", "new_log_probs", "pg_loss", "grad_norm",
                                     "weight_sum", "weight_norm", "update_norm"}
    json.dumps(report, allow_nan=False)


def test_tampered_golden_fails(tmp_path):
    d = tmp_path / "g"
    shutil.copytree(GOLDEN, d)
    exp = load_file(str(d / "expected.safetensors"))
    exp["old_log_probs"] = exp["old_log_probs"] * 1.01
    save_file(exp, str(d / "expected.safetensors"))
    report = replay_golden(d, get_backend("cpu"))
    assert report["checks"]["old_log_probs"]["verdict"] == "fail" and report["verdict"] == "fail"


def test_missing_golden_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        read_golden(tmp_path)


def test_padded_and_packed_forward_agree():
    from portrl.models import compute_logprobs, load_causal_lm

    _, batch, _ = read_golden(GOLDEN)
    model = load_causal_lm(GOLDEN / "model", backend="cpu").eval()
    T = batch["response_mask"].shape[1]
    with torch.no_grad():
        packed, ent_p = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], T, with_entropy=True)
        padded, ent_d = compute_logprobs(model, batch["input_ids"], batch["attention_mask"], T, with_entropy=True,
                                         packed=False)
    assert compare_tensors(packed, padded.double(), "float32")["verdict"] == "pass"
    assert compare_tensors(ent_p, ent_d.double(), "float32")["verdict"] == "pass"


def test_record_replay_cli_roundtrip(tmp_path):
    from portrl.cli import main

    out = tmp_path / "golden"
    assert main(["--log-level", "WARNING", "parity", "record", "--output", str(out)]) == 0
    assert main(["--log-level", "WARNING", "parity", "replay", "--golden", str(out), "--device", "cpu",
                 "--report", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "pass"
    _, _, mine = read_golden(out)
    _, _, committed = read_golden(GOLDEN)
    # the recording is reproducible: this machine records what is committed, to float32 rounding
    for k in committed:
        assert compare_tensors(mine[k], committed[k], "float32")["verdict"] != "fail", k
