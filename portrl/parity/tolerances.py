"""The one table of parity thresholds, by dtype, with where each number comes from.

Per-case checks (a backend's result against a float64 CPU reference computed from the same,
dtype-rounded inputs), following the API accuracy checker of the msprobe precision tool:

* ``cosine_min``: cosine similarity of result and reference must exceed 0.99 (msprobe).
* ``rel_bound`` / ``share_bound``: an element whose relative error exceeds ``rel_bound`` counts as
  over the bound; the share of such elements must stay below ``share_bound`` — 0.1% / 0.1% for
  float32, 1% / 1% for float16 and bfloat16 (msprobe's "relative-error ratio" thresholds).
* ``small_value`` / ``small_abs_bound``: elements whose reference magnitude is below ``small_value``
  (1e-6 float32, 1e-3 half precision) are judged by absolute error instead, which must stay below
  ``small_abs_bound`` (1e-9 / 1e-5) (msprobe's small-value rule).
* ``scaled_bound``: portrl's choice. A result that misses the share rule is a warning, not a failure,
  when its largest error stays within ``scaled_bound`` of the tensor's largest reference magnitude
  (``max|a - r| / max|r|``): rounding and cancellation in a correct low-precision kernel (elements near 0
  after a sum of larger terms) miss the elementwise rule while a wrong kernel errs on the scale of the
  tensor. Measured on CPU, correct kernels reach 1e-5 (float32) and 0.025 (bfloat16, log-prob
  gradients over a 32k vocabulary); the bounds are 1e-4 and 0.04 (about ten bfloat16 roundings).
  msprobe's early pass "max abs error < 0.001" is deliberately not applied: gradients of mean-reduced
  losses are small in scale, so an absolute bound of 0.001 would pass anything.

Implementation-to-implementation checks in the tests use ``assert_close`` (torch.testing.assert_close
defaults) and ``hf_sdpa`` (the tolerances transformers' eager-vs-SDPA model tests use).

Cross-backend (``portrl parity compare``): each backend's error divided by the reference backend's
error on the same case: pass <= 1, warn <= 2, fail > 2 for RMSE, mean relative error and
small-value error; pass <= 1, warn <= 10, fail > 10 for the max relative error (msprobe's
device-vs-device benchmark convention). Errors below ``ratio_floor`` (about one rounding of the dtype) are
raised to it before dividing, so two near-exact results compare as equal rather than as 0 / 0.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = {
    "msprobe": "msprobe API accuracy checker: cosine > 0.99; share of elements with rel err > 0.1% (fp32) / "
               "1% (fp16, bf16) below 0.1% / 1%; |x| < 1e-6 (fp32) / 1e-3 (fp16, bf16) judged by abs err 1e-9 / 1e-5",
    "msprobe_ratio": "msprobe device-vs-device benchmark: error ratio (each vs a CPU high-precision reference) "
                     "of RMSE, mean rel err, small-value err: pass <= 1, warn <= 2, fail > 2; "
                     "max rel err: pass <= 1, warn <= 10",
    "torch_testing": "torch.testing.assert_close default (rtol, atol) by dtype",
    "transformers": "transformers eager-vs-SDPA model tests: fp32 atol 1e-6 rtol 1e-4; fp16 5e-3; bf16 1e-2",
    "portrl": "portrl's choice, stated in the module docstring",
}


@dataclass(frozen=True)
class Tolerance:
    dtype: str
    cosine_min: float
    rel_bound: float
    share_bound: float
    scaled_bound: float
    small_value: float
    small_abs_bound: float
    assert_close: tuple[float, float]  # (rtol, atol)
    hf_sdpa: tuple[float, float]  # (rtol, atol)
    ratio_floor: float  # about one rounding of the dtype (unit roundoff), for relative errors
    ratio_abs_floor: float  # for absolute errors (RMSE)


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance("float32", cosine_min=0.99, rel_bound=1e-3, share_bound=1e-3, scaled_bound=1e-4,
                         small_value=1e-6, small_abs_bound=1e-9, assert_close=(1.3e-6, 1e-5), hf_sdpa=(1e-4, 1e-6),
                         ratio_floor=2.0 ** -24, ratio_abs_floor=1e-9),
    "bfloat16": Tolerance("bfloat16", cosine_min=0.99, rel_bound=1e-2, share_bound=1e-2, scaled_bound=4e-2,
                          small_value=1e-3, small_abs_bound=1e-5, assert_close=(1.6e-2, 1e-5), hf_sdpa=(1e-2, 1e-2),
                          ratio_floor=2.0 ** -8, ratio_abs_floor=1e-5),
    "float16": Tolerance("float16", cosine_min=0.99, rel_bound=1e-2, share_bound=1e-2, scaled_bound=4e-2,
                         small_value=1e-3, small_abs_bound=1e-5, assert_close=(1e-3, 1e-5), hf_sdpa=(5e-3, 5e-3),
                         ratio_floor=2.0 ** -11, ratio_abs_floor=1e-5),
}

#: where each field of the table comes from
FIELD_SOURCES = {
    "cosine_min": "msprobe", "rel_bound": "msprobe", "share_bound": "msprobe", "small_value": "msprobe",
    "small_abs_bound": "msprobe", "scaled_bound": "portrl", "assert_close": "torch_testing",
    "hf_sdpa": "transformers", "ratio_floor": "portrl", "ratio_abs_floor": "portrl",
}

#: cross-backend ratio limits: metric -> (pass at most, warn at most) (msprobe_ratio)
RATIO_LIMITS = {
    "rmse": (1.0, 2.0),
    "mean_rel_err": (1.0, 2.0),
    "small_value_err": (1.0, 2.0),
    "max_rel_err": (1.0, 10.0),
}

VERDICTS = ("pass", "warn", "fail")

#: ``portrl parity rollout`` (portrl/parity/rollout_gap.py): bounds (pass, warn) on ``|log p_trainer - log p_rollout|``
#: over the response tokens (verl's ``training/rollout_log_probs_diff_{mean,max}``), by dtype, for every backend and
#: engine (BACKEND_ROLLOUT_GAP overrides one backend's row). Measured on the CPU with the tiny model (up to 32-token
#: answers, 256 rows; the goldens of every engine there in backends/cpu/rollout_gap_golden.json): hf float32 mean
#: 1.8e-7 / max 1.4e-6, bfloat16 mean 9.3e-4 / max 7.7e-3; the other engine on the CPU within 20 % of those. The bounds leave a decade for other kernels (a fused or paged attention, a
#: different reduction order): float32 pass at mean 1e-5 / max 1e-4; bfloat16 pass at mean 1e-2 / max 0.1, about
#: a decade above one bfloat16 rounding of a log-prob (2**-8 relative). Above the pass bound and within 10x of it
#: warns; beyond, fails.
ROLLOUT_GAP = {
    "float32": {"training/rollout_log_probs_diff_mean": 1e-5, "training/rollout_log_probs_diff_max": 1e-4},
    "bfloat16": {"training/rollout_log_probs_diff_mean": 1e-2, "training/rollout_log_probs_diff_max": 0.1},
}
BACKEND_ROLLOUT_GAP: dict[str, dict[str, dict[str, float]]] = {}
ROLLOUT_GAP_WARN_FACTOR = 10.0


def tolerance(dtype) -> Tolerance:
    """The row for ``dtype`` (a name like "bfloat16" or a torch dtype)."""
    name = str(dtype).replace("torch.", "")
    if name not in TOLERANCES:
        raise ValueError(f"no parity tolerances for dtype {name!r}; valid: {', '.join(TOLERANCES)}")
    return TOLERANCES[name]


def worst(verdicts) -> str:
    """The worst of some verdicts ("pass" < "warn" < "fail"); "pass" when there are none."""
    return max(verdicts, key=VERDICTS.index, default="pass")


def ratio_verdict(metric: str, ratio: float) -> str:
    """Verdict of a cross-backend error ratio (``RATIO_LIMITS``)."""
    if metric not in RATIO_LIMITS:
        raise ValueError(f"no ratio limits for {metric!r}; valid: {', '.join(RATIO_LIMITS)}")
    ok, warn = RATIO_LIMITS[metric]
    if not ratio <= warn:  # NaN fails too
        return "fail"
    return "pass" if ratio <= ok else "warn"
