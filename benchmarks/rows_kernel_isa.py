"""The decode linear's variants side by side in one run: the rows kernel's AVX-512 and AVX2 + FMA builds
(backends/cpu/rows_linear.cpp) and F.linear, on Qwen2.5-0.5B's decode shapes at 1-64 rows.

For each shape (out_features x in_features) and row count it prints the median time per call, the weight read rate
(GB/s: the weight's bytes per call over the time; a decode step reads every weight once) and each kernel's
speed-up over F.linear. A variant this CPU cannot run (no AVX-512 here) is left out and said so. Times are medians
of ``--repeats`` calls after ``--warmup`` (``--stat min``: the fastest call, the least disturbed one, for a busy
machine); compare within one run.

    python benchmarks/rows_kernel_isa.py   # 896x896, 128x896, 4864x896, 896x4864 at 1, 8, 16, 32, 64 rows
    python benchmarks/rows_kernel_isa.py --vocab --repeats 5 --rows 1 16
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
    names = [*variants, "F.linear"]
    stat = statistics.median if args.stat == "median" else min
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


if __name__ == "__main__":
    main()
