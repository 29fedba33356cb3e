"""The decode linear's variants side by side in one run: the rows kernel's AVX-512 and AVX2 + FMA builds
(backends/cpu/rows_linear.cpp) and F.linear, on Qwen2.5-0.5B's decode shapes at 1-64 rows.

For each shape (out_features x in_features) and row count it prints the median time per call, the weight read rate
(GB/s: the weight's bytes per call over the time; a decode step reads every weight once) and each kernel's
speed-up over F.linear. A variant this CPU cannot run (no AVX-512 here) is left out and said so. Times are medians
of ``--repeats`` calls after ``--warmup`` (``--stat min``: the fastest call, the least disturbed one, for a busy
machine); compare within one run.

    python benchmarks/rows_kernel_isa.py   # 896x896, 128x896, 4864x896, 896x4864 at 1, 8, 16, 32, 64 rows
    python benchmarks/rows_kernel_isa.py --vocab --repeats 5 --rows 1 16
    python benchmarks/rows_kernel_isa.py --model-pass --rows 8 12 16 32   # a whole decode step's linears

``--model-pass``: every linear of one Qwen2.5-0.5B decode step (24 layers' fused q/k/v, o, fused gate/up and down,
then the LM head; 1.98 GB of random weights, so each is read from memory as in a real decode, where a single
shape called back to back may stay in the last-level cache) at each row count, each way in turn, repeated and
alternated: the AVX-512 build's lane tiles and dot tiles (rows_linear.cpp's two tilings, forced), the AVX2 build
(dot tiles) and F.linear (a fused weight's parts one call each). Prints ms per pass, the weight read rate
and each way's time over the lane tiles'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from portrl.backends.cpu import isa
from portrl.backends.cpu.kernels import linear_prepacked_rows

#: Qwen2.5-0.5B's decode linears (out_features, in_features): o_proj, k/v_proj, gate/up_proj, down_proj
SHAPES = [(896, 896), (128, 896), (4864, 896), (896, 4864)]
VOCAB = (151936, 896)  # the tied LM head
#: one decoder layer's decode linears as the fast decoder calls them: (the parts' out_features, in_features)
PASS_LAYER = [((896, 128, 128), 896), ((896,), 896), ((4864, 4864), 896), ((896,), 4864)]


def timed(fn, x, warmup: int, repeats: int, stat=statistics.median) -> float:
    """``stat`` (median) of the seconds of ``repeats`` calls ``fn(x)`` after ``warmup``."""
    for _ in range(warmup):
        fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return stat(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", action="store_true",
                   help=f"also the {VOCAB[0]}x{VOCAB[1]} LM head (0.54 GB read per call)")
    p.add_argument("--stat", choices=("median", "min"), default="median")
    p.add_argument("--model-pass", action="store_true", help="whole decode steps' linears (module docstring)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = isa.cpu_flags()
    variants = [v for v in isa.NEEDS if not isa.missing(v, flags)]
    print(f"# CPU: {isa.cpu_model()} | runs: {', '.join(variants) or 'no variant'} | torch {torch.__version__} "
          f"capability {torch.backends.cpu.get_cpu_capability()} | {torch.get_num_threads()} threads | {args.stat} "
          f"of {args.repeats} calls")
    for v in isa.NEEDS:
        if v not in variants:
            print(f"# {v}: not on this CPU (lacks {'/'.join(isa.missing(v, flags))})")
    stat = statistics.median if args.stat == "median" else min
    if args.model_pass:
        model_pass(variants, args.rows, args.repeats, stat)
        return
    names = [*variants, "F.linear"]
    print(f"{'shape':>12} {'rows':>4} " + " ".join(f"{n + ' ms':>12} {'GB/s':>6}" for n in names)
          + "".join(f" {v + '/F':>10}" for v in variants))
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [*SHAPES, *([VOCAB] if args.vocab else [])]:
        w = torch.randn(out_f, in_f, generator=g) * 0.02
        gb = w.numel() * 4 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=g)
            fns = {v: linear_prepacked_rows(w, None, rows=rows, variant=v) for v in variants}
            fns["F.linear"] = lambda x, w=w: F.linear(x, w)
            want = F.linear(x.double(), w.double()).float()
            for v in variants:  # a wrong kernel is no benchmark
                torch.testing.assert_close(fns[v](x), want, atol=2e-6 * in_f, rtol=1e-5)
            secs = {n: timed(fns[n], x, args.warmup, args.repeats, stat) for n in names}
            print(f"{f'{out_f}x{in_f}':>12} {rows:>4} " + " ".join(f"{secs[n] * 1e3:>12.3f} {gb / secs[n]:>6.1f}"
                                                                 for n in names)
                  + "".join(f" {secs['F.linear'] / secs[v]:>9.2f}x" for v in variants), flush=True)


def model_pass(variants: list[str], rows_list: list[int], repeats: int, stat) -> None:
    """One decode step's linears of Qwen2.5-0.5B, each way (module docstring), ``repeats`` alternated rounds."""
    from portrl.backends.cpu import kernels, native_build

    g = torch.Generator().manual_seed(0)
    layers = [[[torch.randn(o, i, generator=g) * 0.02 for o in outs] for outs, i in PASS_LAYER] for _ in range(24)]
    parts = [p for layer in layers for p in layer] + [[torch.randn(*VOCAB, generator=g) * 0.02]]
    gb = sum(w.numel() for p in parts for w in p) * 4 / 1e9
    ways = {}
    for v in variants:
        if native_build.try_load("rows_linear", v):
            op = kernels.rows_op(v)
            if v == "avx512":
                ways["avx512 lanes"] = lambda xs, op=op: [op(xs[p[0].shape[1]], p, None, 1) for p in parts]
                ways["avx512 dot"] = lambda xs, op=op: [op(xs[p[0].shape[1]], p, None, 1 << 30) for p in parts]
            else:
                ways[v] = lambda xs, op=op: [op(xs[p[0].shape[1]], p, None) for p in parts]
    ways["F.linear"] = lambda xs: [[F.linear(xs[w.shape[1]], w) for w in p] for p in parts]  # a part at a time
    print(f"# one decode step's linears: {len(parts)} calls, {gb:.2f} GB of weights; {stat.__name__} of {repeats} "
          f"rounds, the ways alternated")
    first = next(iter(ways))
    print(f"{'rows':>4} " + " ".join(f"{n + ' ms':>16} {'GB/s':>5}" for n in ways) + f"   time / {first}")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in (896, 4864)}
        for fn in ways.values():  # warm up (and build)
            fn(xs)
        secs: dict = {n: [] for n in ways}
        for _ in range(repeats):
            for n, fn in ways.items():
                start = time.perf_counter()
                fn(xs)
                secs[n].append(time.perf_counter() - start)
        t = {n: stat(s) for n, s in secs.items()}
        print(f"{rows:>4} " + " ".join(f"{t[n] * 1e3:>16.1f} {gb / t[n]:>5.1f}" for n in ways) + "   "
              + " ".join(f"{n} {t[n] / t[first]:.2f}" for n in ways), flush=True)


if __name__ == "__main__":
    main()
