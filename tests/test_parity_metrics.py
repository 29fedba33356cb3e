"""Parity metrics, tolerance table, cross-backend compare matrix and the rank-at-first-divergence check."""

import copy
import json

import pytest
import torch

from _logprob_rank import first_divergence, rank_check
from portrl.parity.compare import compare_reports
from portrl.parity.metrics import compare_outputs, compare_tensors
from portrl.parity.tolerances import FIELD_SOURCES, SOURCES, TOLERANCES, ratio_verdict, tolerance, worst


def test_table_has_every_dtype_with_sources():
    assert set(TOLERANCES) == {"float32", "bfloat16", "float16"}
    assert TOLERANCES["float32"].rel_bound == 1e-3 and TOLERANCES["bfloat16"].share_bound == 1e-2
    assert TOLERANCES["float32"].small_value == 1e-6 and TOLERANCES["float16"].small_abs_bound == 1e-5
    assert TOLERANCES["bfloat16"].assert_close == (1.6e-2, 1e-5)
    for row in TOLERANCES.values():
        for name in row.__dataclass_fields__:
            if name != "dtype":
                assert FIELD_SOURCES[name] in SOURCES
    assert tolerance(torch.bfloat16) is TOLERANCES["bfloat16"]
    with pytest.raises(ValueError, match="valid: float32, bfloat16, float16"):
        tolerance("int8")


def test_identical_passes_and_metrics_are_right():
    r = torch.tensor([1.0, -2.0, 4.0, 1e-8])
    m = compare_tensors(r.clone(), r, "float32")
    assert m["verdict"] == "pass" and m["max_abs_err"] == 0 and m["cosine"] == pytest.approx(1.0)
    a = r.clone()
    a[2] = 4.002  # rel err 5e-4 is within the fp32 bound (1e-3); 1.5e-3 is over it
    a[0] = 1.0015
    m = compare_tensors(a, r.double(), "float32")
    assert m["max_rel_err"] == pytest.approx(1.5e-3, rel=1e-3)
    assert m["share_over"] == pytest.approx(0.25)  # only element 0 is over
    assert m["scaled_err"] == pytest.approx(0.002 / 4, rel=1e-3)
    assert m["verdict"] == "fail"  # share 25% over 0.1% and error 5e-4 of the scale > 1e-4


def test_small_values_use_absolute_bound():
    r = torch.full((1000,), 1e-7, dtype=torch.float64)
    a = r + 5e-10  # relative error 0.5% but absolute 5e-10 < 1e-9
    assert compare_tensors(a, r, "float32")["share_over"] == 0
    a = r + 5e-9
    assert compare_tensors(a, r, "float32")["share_over"] == 1.0


def test_warn_when_only_cancellation_elements_miss():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(10000, generator=g, dtype=torch.float64)
    a = r + 2e-3 * torch.randn(10000, generator=g, dtype=torch.float64)  # bf16-like absolute noise
    m = compare_tensors(a, r, "bfloat16")
    assert m["share_over"] > 0.01 and m["verdict"] == "warn"
    assert compare_tensors(r + 0.3 * torch.randn(10000, generator=g, dtype=torch.float64), r,
                           "bfloat16")["verdict"] == "fail"


def test_nan_inf_mismatch_and_cosine_fail():
    r = torch.tensor([1.0, float("inf"), float("nan"), 2.0])
    assert compare_tensors(r.clone(), r, "float32")["verdict"] == "pass"
    a = r.clone()
    a[1] = float("-inf")
    m = compare_tensors(a, r, "float32")
    assert m["nan_inf_mismatch"] == 1 and m["verdict"] == "fail"
    assert compare_tensors(-torch.ones(8), torch.ones(8), "float32")["cosine"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="shape"):
        compare_tensors(torch.ones(2), torch.ones(3), "float32")
    out = compare_outputs({"x": r.clone(), "y": a}, {"x": r, "y": r}, "float32")
    assert out["verdict"] == "fail" and out["outputs"]["x"]["verdict"] == "pass"


def test_ratio_convention():
    assert ratio_verdict("rmse", 1.0) == "pass" and ratio_verdict("rmse", 2.0) == "warn"
    assert ratio_verdict("rmse", 2.01) == "fail" and ratio_verdict("max_rel_err", 9.0) == "warn"
    assert ratio_verdict("max_rel_err", 11) == "fail" and ratio_verdict("rmse", float("nan")) == "fail"
    assert worst(["pass", "warn"]) == "warn" and worst([]) == "pass"


def _report(backend, dtype, errs, verdict="pass"):
    outputs = {"out": {"rmse": errs * 1e-3, "mean_rel_err": errs, "small_value_err": 0.0, "max_rel_err": errs,
                       "verdict": verdict}}
    return {"kind": "ops", "version": 1, "backend": backend, "dtype": dtype, "size": "standard",
            "cases": [{"name": "rms_norm[native]", "verdict": verdict, "max_rel_err": errs, "outputs": outputs}]}


def test_compare_matrix_and_ratios():
    ref = _report("cpu", "bfloat16", 1e-2)
    same = _report("cuda", "bfloat16", 1e-2)
    md, summary = compare_reports([ref, same])
    assert "| rms_norm[native] | 1.00e-02 pass | 1.00e-02 pass |" in md
    assert summary["ratios"]["cuda/bfloat16"]["rms_norm[native]"]["verdict"] == "pass"
    worse = _report("npu", "bfloat16", 3e-2)
    _, summary = compare_reports([ref, worse])
    res = summary["ratios"]["npu/bfloat16"]["rms_norm[native]"]
    assert res["ratio"] == pytest.approx(3.0) and res["verdict"] == "fail" and summary["verdict"] == "fail"
    # errors below one bf16 rounding count as equal
    _, summary = compare_reports([_report("cpu", "bfloat16", 0.0), _report("rocm", "bfloat16", 1e-3)])
    assert summary["ratios"]["rocm/bfloat16"]["rms_norm[native]"]["verdict"] == "pass"
    md, _ = compare_reports([ref, _report("cuda", "float32", 1e-7)])
    assert "No cpu report in the same dtype for: cuda/float32" in md
    with pytest.raises(ValueError, match="same backend/dtype"):
        compare_reports([ref, copy.deepcopy(ref)])


def test_compare_cli(tmp_path, capsys):
    from portrl.cli import main

    paths = []
    for r in (_report("cpu", "float32", 1e-7), _report("cuda", "float32", 1e-7)):
        p = tmp_path / f"{r['backend']}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    assert main(["parity", "compare", *paths, "--output", str(tmp_path / "m.md")]) == 0
    assert "cuda/float32" in (tmp_path / "m.md").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["parity", "compare", str(bad)]) == 2
    assert "not a `portrl parity ops` report" in capsys.readouterr().err


def _sample(tokens, tops):
    return tokens, [dict(t) for t in tops]


def test_rank_check_at_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1 and first_divergence([1, 2], [1, 2, 3]) == 2
    tops_a = [{1: -0.1, 9: -3.0}, {2: -0.6, 5: -0.8}, {3: -0.2}]
    tops_b = [{1: -0.11, 9: -3.0}, {5: -0.7, 2: -0.71}, {3: -0.2}]
    ok = rank_check([_sample([1, 2, 3], tops_a)], [_sample([1, 5, 3], tops_b)], names=("hf", "vllm"))[0]
    assert ok["ok"] and ok["first_diff"] == 1 and ok["max_shared_logprob_gap"] == pytest.approx(0.01)
    bad_b = [{1: -0.11}, {7: -0.1, 5: -2.0}, {3: -0.2}]
    bad = rank_check([_sample([1, 2, 3], tops_a)], [_sample([1, 7, 3], bad_b)], names=("hf", "vllm"))[0]
    assert not bad["ok"] and "hf token 2 not in vllm top-k" in bad["reason"]
    same = rank_check([_sample([1, 2], tops_a[:2])], [_sample([1, 2], tops_a[:2])])[0]
    assert same["ok"] and same["reason"] == "identical"
    short = rank_check([_sample([1], tops_a[:1])], [_sample([1, 2], tops_a[:2])])[0]
    assert not short["ok"] and "stopped at 1" in short["reason"]
    with pytest.raises(ValueError, match="1 samples"):
        rank_check([_sample([1], tops_a[:1])], [])
