"""The decode step's attention side by side in one run: torch's four ops (portrl.ops.attention.decode_attention,
the op's native implementation) and the CPU's fused kernel in each instruction-set variant this CPU runs
(backends/cpu/decode_attention.cpp), on the benchmarks' decode shapes (one query per row, a cache view of L keys).

For each shape it prints the median time per call (one layer), the cache read rate (GB/s: the keys and values read
over the time) and each kernel's speed-up over torch. Compare within one run.

    python benchmarks/decode_attention.py                 # small, medium and Qwen2.5-0.5B shapes
    python benchmarks/decode_attention.py --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from portrl.backends.cpu import isa
from portrl.backends.cpu.decode_attention import decode_attention_fused
from portrl.ops.attention import decode_attention

#: name -> (rows, query heads, KV heads, head dim, keys): the vs_trl configurations' decode steps (32 rows of 8 x 4
#: samples; Qwen2.5-0.5B: 4 x 4 rows, GSM8K prompts of ~120 tokens plus up to 128 new ones)
SHAPES = {"small": (32, 4, 2, 32, 40), "medium": (32, 8, 2, 64, 40), "qwen2.5-0.5b L=128": (16, 14, 2, 64, 128),
          "qwen2.5-0.5b L=250": (16, 14, 2, 64, 250), "64 rows, L=512": (64, 14, 2, 64, 512)}


def timed(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    variants = [v for v in isa.NEEDS if not isa.missing(v, isa.cpu_flags())]
    print(f"host: {isa.cpu_model()}; torch threads {torch.get_num_threads()}; variants run here: "
          f"{', '.join(variants) or 'none'}; the default here: {isa.chosen().variant}")
    for name, (B, H, KV, D, L) in SHAPES.items():
        cache = torch.randn(2, B, KV, L + 64, D)
        q = torch.randn(B, 1, H + KV, D)[:, :, :H].transpose(1, 2)
        k, v = cache[0, :, :, :L], cache[1, :, :, :L]
        k_t = torch.randn(B, KV, D, L + 64)[..., :L].transpose(-1, -2)  # keys stored transposed, as the decoder's
        hidden = torch.rand(B, L) < 0.2
        hidden[:, -1] = False
        gb = 2 * B * KV * L * D * 4 / 1e9
        base = timed(lambda: decode_attention(q, k, v, hidden, D ** -0.5), args.warmup, args.repeats)
        print(f"{name} (B={B} H={H} KV={KV} D={D} L={L}), us per layer (cache GB/s, speed-up over torch):\n"
              f"  torch, keys as rows   {base * 1e6:8.1f} ({gb / base:5.1f})", flush=True)
        for label, keys in (("keys as rows", k), ("keys transposed", k_t)):
            if keys is k_t:
                t = timed(lambda: decode_attention(q, keys, v, hidden, D ** -0.5), args.warmup, args.repeats)
                print(f"  torch, {label:15s}{t * 1e6:8.1f} ({gb / t:5.1f}, {base / t:4.1f}x)", flush=True)
            for variant in variants:
                t = timed(lambda: decode_attention_fused(q, keys, v, hidden, D ** -0.5, variant=variant), args.warmup,
                          args.repeats)
                print(f"  {variant}, {label:15s}{t * 1e6:9.1f} ({gb / t:5.1f}, {base / t:4.1f}x)", flush=True)


if __name__ == "__main__":
    main()
