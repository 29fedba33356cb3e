"""ci/device_check.sh and its report (ci/device_report.py): argument errors, and the report built from a check's
folder. The whole CPU leg of the check runs in .ci/run (`bash ci/device_check.sh --device cpu`)."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ci" / "device_check.sh"


@pytest.fixture(scope="module")
def report_mod():
    spec = importlib.util.spec_from_file_location("device_report", ROOT / "ci" / "device_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, says", [
    (["--device", "tpu"], "--device 'tpu' is not one of auto, cpu, cuda, rocm, npu"),
    (["--fast"], "unknown argument '--fast'"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, says, tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_with_a_report_is_refused(tmp_path):
    (tmp_path / "report.json").write_text("{}")
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "already holds a report" in proc.stderr
    assert (tmp_path / "report.json").read_text() == "{}"


def _check_folder(out: Path) -> None:
    (out / "parts.tsv").write_text("install\tskipped\t0\t--no-install\ndoctor\tpass\t2\t\n"
                                   "ops-float32\tfail\t9\texit 1: fail tir\nrollout-gap\tpass\t20\t\ngrpo-hf\tpass\t30\t\n"
                                   "grpo-vllm\tskipped\t0\tvllm is not installed\n")
    (out / "doctor.log").write_text('2026-12-04 INFO portrl: log line first\n{"checks": ['
                                    '{"name": "probe", "status": "ok", "message": "usable", "fix": ""},'
                                    '{"name": "rows", "status": "warn", "message": "vllm 0.9", "fix": "pip x"}]}')
    (out / "ops-float32.json").write_text(json.dumps({
        "backend": "cuda", "device_name": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "python": "3.12",
        "host": "x86_64", "summary": {"pass": 1, "warn": 0, "fail": 1},
        "impls": {"rms_norm": {"selected": "triton"}},
        "cases": [{"name": "rms_norm[triton]", "verdict": "pass"},
                  {"name": "adv_estimator[tir_optimal_token_baseline]", "verdict": "fail"}]}))
    (out / "rollout-gap.json").write_text(json.dumps({"cases": [
        {"engine": "hf", "dtype": "bfloat16", "verdict": "pass", "training/rollout_log_probs_diff_mean": 1e-3,
         "training/rollout_log_probs_diff_max": 8e-3, "bounds": {}}]}))
    (out / "run-hf").mkdir()
    (out / "run-hf" / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "val/acc": 0.1}) + "\n"
        + json.dumps({"step": 1, "timing_s/step": 2.5, "memory/peak_gib/step": 0.12,
                      "training/rollout_probs_diff_max": 1e-8}) + "\n")
    (out / "run-hf" / "profile" / "step_2").mkdir(parents=True)
    (out / "run-hf" / "profile" / "step_2" / "driver.json").write_text(json.dumps({"traceEvents": [
        {"name": "portrl/gen", "ph": "X"}, {"name": "portrl/step", "ph": "X"}, {"name": "gemm", "cat": "kernel"},
        {"name": "aten::mm", "cat": "cpu_op"}]}))


def test_report_names_failures_skips_and_step_figures(report_mod, tmp_path):
    _check_folder(tmp_path)
    assert report_mod.main([str(tmp_path), "cuda"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] == ["ops-float32"]
    assert report["not_run"] == ["install: --no-install", "grpo-vllm: vllm is not installed"]
    parts = {p["name"]: p for p in report["parts"]}
    assert parts["doctor"]["details"]["counts"] == {"ok": 1, "warn": 1, "fail": 0}
    assert parts["doctor"]["details"]["flagged"] == ["warn: rows: vllm 0.9 (fix: pip x)"]
    assert parts["ops-float32"]["details"]["not_pass"] == ["fail: adv_estimator[tir_optimal_token_baseline]"]
    assert parts["grpo-hf"]["details"]["steps"] == [{"step": 1, "timing_s/step": 2.5, "memory/peak_gib/step": 0.12,
                                                     "training/rollout_probs_diff_max": 1e-8}]
    assert parts["grpo-hf"]["details"]["profile"] == [
        {"trace": "profile/step_2/driver.json", "phases": ["portrl/gen", "portrl/step"], "device_events": 1}]
    assert parts["rollout-gap"]["details"]["cases"] == [
        {"engine": "hf", "dtype": "bfloat16", "verdict": "pass", "training/rollout_log_probs_diff_mean": 1e-3,
         "training/rollout_log_probs_diff_max": 8e-3}]
    assert "- pass: hf bfloat16: |dlogp| mean 0.001, max 0.008" in (tmp_path / "report.md").read_text()
    assert "details" not in parts["grpo-vllm"]
    text = (tmp_path / "report.md").read_text()
    assert "Device: NVIDIA H200; torch 2.11.0" in text and "| ops-float32 | fail | 9 | exit 1: fail tir |" in text
    assert "Failed: ops-float32" in text
