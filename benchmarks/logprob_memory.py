"""Chunked log-prob + entropy vs the naive full-logits computation at Qwen2's vocabulary (151,936).

Each side (forward + backward w.r.t. hidden states and LM head) runs in its own Python process so
its peak resident memory is its own: peak = VmHWM - VmRSS measured after the inputs exist (the
weight gradient, V x H, is counted on both sides). Time is the median of ``--repeats`` runs after
one warm-up. Prints both sides and the ratios chunked / naive, and the max abs difference of the
outputs and gradients.

    python benchmarks/logprob_memory.py [--tokens 1024] [--hidden 256] [--vocab 151936] [--chunk N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def run_side(side: str, tokens: int, hidden: int, vocab: int, chunk: int | None, repeats: int) -> dict:
    import torch

    from portrl.ops import logprobs_entropy, logprobs_entropy_full

    torch.manual_seed(0)
    h = (0.5 * torch.randn(tokens, hidden)).requires_grad_()
    w = (0.05 * torch.randn(vocab, hidden)).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    gl, ge = torch.randn(tokens), torch.randn(tokens)
    fn = (lambda: logprobs_entropy(h, w, y, 1.0, None, chunk)) if side == "chunked" else \
        (lambda: logprobs_entropy_full(h, w, y, 1.0))

    def step():
        h.grad = w.grad = None
        lp, ent = fn()
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        return lp.detach(), ent.detach()

    base = _common.status_kb("VmRSS")
    lp, ent = step()
    peak = _common.status_kb("VmHWM") - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    sample = torch.cat([lp[:64], ent[:64], h.grad[:8].reshape(-1), w.grad[:64].reshape(-1)]).tolist()
    return {"side": side, "peak_mb": peak / 1024, "seconds": statistics.median(times), "sample": sample}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--side", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        print(json.dumps(run_side(a.side, a.tokens, a.hidden, a.vocab, a.chunk, a.repeats)))
        return 0
    results = {}
    for side in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--side", side, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
               "--vocab", str(a.vocab), "--repeats", str(a.repeats)] + (["--chunk", str(a.chunk)] if a.chunk else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ})
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])
    n, c = results["naive"], results["chunked"]
    diff = max(abs(x - y) for x, y in zip(n["sample"], c["sample"]))
    print(f"tokens={a.tokens} hidden={a.hidden} vocab={a.vocab} (forward + backward, float32)")
    print(f"{'':10s} {'peak MB':>10s} {'seconds':>10s}")
    for side in ("naive", "chunked"):
        print(f"{side:10s} {results[side]['peak_mb']:10.1f} {results[side]['seconds']:10.3f}")
    print(f"ratio chunked/naive: peak memory {c['peak_mb'] / n['peak_mb']:.3f}x (target <= 0.25), "
          f"time {c['seconds'] / n['seconds']:.3f}x (target <= 1.10)")
    print(f"max abs difference (logp, entropy, grads sample): {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
