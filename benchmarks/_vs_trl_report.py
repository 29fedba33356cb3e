"""benchmarks/vs_trl.py's results: a side's rounds pooled, summarized per step and printed beside the other side's,
with the ratios portrl/TRL (the last line of vs_trl.py: ``step_time_ratio``; scaling.py summarizes its points here
too)."""

from __future__ import annotations

import _common


def merge_rounds(results: list) -> dict:
    """Pool the timed steps of several rounds of one side; peak RSS is the largest of them; each ceiling the
    best of the rounds."""
    out = {k: [x for r in results for x in r[k]] for k in ("step_times", "step_cpu", "gen_times", "gen_tokens")}
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    for k in ("decode", "update"):
        if all(k in r for r in results):
            out[k] = [x for r in results for x in r[k]]
    if all("ceilings" in r for r in results):
        out["ceilings"] = {"read": max((r["ceilings"]["read"] for r in results), key=lambda c: c["bytes_per_s"]),
                           "matmul": max((r["ceilings"]["matmul"] for r in results), key=lambda c: c["flops_per_s"])}
    out.update({k: results[-1][k] for k in ("checkpointing", "host") if results and k in results[-1]})
    return out


def summarize(res: dict) -> dict:
    st, gt, tok = res["step_times"], res["gen_times"], res["gen_tokens"]
    med = _common.median(st)
    tokens_per_step = _common.median(tok)
    return {
        "s_per_step": med,
        "cpu_s_per_step": _common.median(res["step_cpu"]),
        "tokens_per_s": tokens_per_step / med,
        "gen_tokens_per_s": sum(tok) / sum(gt),
        "gen_s_per_step": _common.median(gt),
        "tokens_per_step": tokens_per_step,
        "peak_rss_mb": res["peak_rss_mb"],
    }


def print_config(name: str, summary: dict, hosts: dict | None = None, header: str = "") -> float | None:
    print(f"\n== {name} ==")
    print("".join(f"{side} ran on: {line}\n" for side, line in (hosts or {}).items() if line != header), end="")
    print(f"{'side':8s} {'s/step':>8s} {'cpu s/step':>10s} {'gen s/step':>10s} {'tok/step':>8s} {'tok/s':>8s} {'gen tok/s':>9s} {'peak RSS MiB':>12s}")
    for side, s in summary.items():
        print(f"{side:8s} {s['s_per_step']:8.3f} {s['cpu_s_per_step']:10.3f} {s['gen_s_per_step']:10.3f} {s['tokens_per_step']:8.0f} "
              f"{s['tokens_per_s']:8.1f} {s['gen_tokens_per_s']:9.1f} {s['peak_rss_mb']:12.0f}")
    if "trl" in summary and "portrl" in summary:
        p, t = summary["portrl"], summary["trl"]
        ratio = p["s_per_step"] / t["s_per_step"]
        print(f"{name}: step_time_ratio (portrl/trl) = {ratio:.3f}   tokens/s ratio = "
              f"{p['tokens_per_s'] / t['tokens_per_s']:.2f}   rollout gen tokens/s ratio = "
              f"{p['gen_tokens_per_s'] / t['gen_tokens_per_s']:.2f}   peak RSS ratio = "
              f"{p['peak_rss_mb'] / t['peak_rss_mb']:.2f}   cpu-time ratio = "
              f"{p['cpu_s_per_step'] / t['cpu_s_per_step']:.3f}")
        return ratio
    return None
