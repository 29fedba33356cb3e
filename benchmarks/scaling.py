"""How portrl's GRPO step time grows with prompts, samples per prompt and response length (issue 10).

    python benchmarks/scaling.py [--config small] [--steps 2] [--warmup 1] [--with-trl]
                                 [--prompts 4,8,16,32] [--samples 2,4,8,16] [--lengths 16,32,64,128]

From the base workload of benchmarks/vs_trl.py (8 prompts x 4 samples, at most 32 new tokens,
float32, 2 threads, no KL) one axis is varied at a time. Each point runs in its own process
(``vs_trl.py``'s worker: RLTrainer.train_step, the real step) for warmup + steps steps; the table
shows the median step time, its generation part, response tokens per step, tokens/s and the
time per 1000 response tokens (flat = linear cost, rising = super-linear). ``--with-trl`` adds
TRL's GRPOTrainer at every point and the ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import vs_trl  # noqa: E402


def _ints(text: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def points(prompts, samples, lengths, base=(vs_trl.PROMPTS_PER_STEP, vs_trl.SAMPLES, vs_trl.MAX_NEW_TOKENS)):
    """(axis, prompts, samples, max_new) for each point: the base, then one axis varied at a time."""
    out = [("base", *base)]
    out += [("prompts", p, base[1], base[2]) for p in prompts if p != base[0]]
    out += [("samples", base[0], s, base[2]) for s in samples if s != base[1]]
    out += [("length", base[0], base[1], n) for n in lengths if n != base[2]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small", choices=sorted(_common.CONFIGS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=_ints, default=[4, 8, 16, 32])
    ap.add_argument("--samples", type=_ints, default=[2, 4, 8, 16])
    ap.add_argument("--lengths", type=_ints, default=[16, 32, 64, 128])
    ap.add_argument("--with-trl", action="store_true", help="run TRL's GRPOTrainer at every point too")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    sides = ["portrl", "trl"] if a.with_trl else ["portrl"]
    script = Path(vs_trl.__file__).resolve()
    print(f"config {a.config}; float32, {vs_trl.THREADS} threads, no KL; {a.warmup} warmup + {a.steps} timed steps "
          f"per point")
    head = f"{'axis':8s} {'prompts':>7s} {'samples':>7s} {'max_new':>7s} {'rows':>5s}"
    for side in sides:
        head += f" | {side + ' s/step':>13s} {'gen s':>7s} {'tok/step':>8s} {'tok/s':>7s} {'s/1k tok':>8s}"
    if a.with_trl:
        head += f" | {'ratio':>6s}"
    rows = []
    import tempfile

    with tempfile.TemporaryDirectory(prefix="portrl-scaling-") as tmp:
        model_dir = _common.build_model(a.config, Path(tmp) / a.config)
        print(head)
        for axis, p, s, n in points(a.prompts, a.samples, a.lengths):
            line = f"{axis:8s} {p:7d} {s:7d} {n:7d} {p * s:5d}"
            step = {}
            for side in sides:
                res = _common.run_side(script, ["--worker", side, "--model-dir", str(model_dir), "--steps", str(a.steps),
                                                "--warmup", str(a.warmup), "--prompts", str(p), "--samples", str(s),
                                                "--max-new", str(n)], verbose=a.verbose,
                                           env_defaults=vs_trl.side_env(side))
                m = vs_trl.summarize(res)
                step[side] = m["s_per_step"]
                line += (f" | {m['s_per_step']:13.3f} {m['gen_s_per_step']:7.3f} {m['tokens_per_step']:8.0f} "
                         f"{m['tokens_per_s']:7.1f} {1000 * m['s_per_step'] / max(m['tokens_per_step'], 1):8.3f}")
            if a.with_trl:
                line += f" | {step['portrl'] / step['trl']:6.3f}"
            print(line, flush=True)
            rows.append(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
