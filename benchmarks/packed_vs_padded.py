"""Packed vs padded training forward + backward on batches whose sequence lengths vary 4 to 1.

Same tiny Qwen2 model, same batch (verl layout: left-padded prompt + right-padded response), the
response log-probs of ``compute_logprobs`` plus backward:

* padded: the (B, L) batch through transformers' own SDPA attention with its 4-D padding mask;
* packed: padding removed, one row of real tokens with position_ids restarting per sequence,
  through the backend's varlen attention (portrl's attention in transformers).

Tokens/s counts real (unpadded) tokens. Both sides alternate in one process, median of
``--repeats``, timed by wall clock and by this process's CPU time (the steadier of the two on a
shared machine; ``--threads`` torch threads, default 1). Prints the ratios packed / padded and the
max abs difference of the log-probs.

    python benchmarks/packed_vs_padded.py [--batch 16] [--max-len 512] [--hidden 256] [--layers 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def make_batch(batch: int, max_len: int, seed: int = 0):
    """Lengths spread evenly over [max_len/4, max_len] (shuffled), half prompt, half response."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(max_len // 4, max_len, batch).round().long()[torch.randperm(batch, generator=g)]
    P = T = max_len // 2
    ids = torch.randint(0, 256, (batch, P + T), generator=g)
    mask = torch.zeros(batch, P + T, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        p = max(1, n // 2)
        mask[b, P - p:P] = 1
        mask[b, P:P + n - p] = 1
    return ids.masked_fill(mask == 0, 256), mask, T


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)

    from portrl.models import compute_logprobs, load_causal_lm, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        path = write_tiny_model(tmp + "/model", hidden_size=a.hidden, num_layers=a.layers,
                                num_heads=max(1, a.hidden // 64), num_kv_heads=max(1, a.hidden // 128))
        models = {
            "padded": (load_causal_lm(path, backend=a.device, attn_impl="hf_sdpa"), False),
            "packed": (load_causal_lm(path, backend=a.device), True),
        }
    ids, mask, T = make_batch(a.batch, a.max_len)
    real_tokens = int(mask.sum())

    def step(name):
        model, packed = models[name]
        model.zero_grad(set_to_none=True)
        logp, ent = compute_logprobs(model, ids, mask, T, with_entropy=True, packed=packed)
        (logp.sum() + 0.01 * ent.sum()).backward()
        return logp.detach()

    outs = {name: step(name) for name in models}  # warm-up
    wall = {name: [] for name in models}
    cpu = {name: [] for name in models}
    for _ in range(a.repeats):
        for name in models:
            t0, c0 = time.perf_counter(), time.process_time()
            step(name)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    print(f"batch={a.batch} lengths {a.max_len // 4}..{a.max_len} (4:1), real tokens {real_tokens} of "
          f"{ids.numel()} padded; hidden={a.hidden} layers={a.layers} threads={a.threads}; packed attention "
          f"{models['packed'][0].portrl_kernels['attention_varlen']}")
    for label, times in (("wall", wall), ("cpu", cpu)):
        tps = {name: real_tokens / statistics.median(ts) for name, ts in times.items()}
        for name in models:
            print(f"{label:4s} {name:8s} {statistics.median(times[name]):8.3f} s/step {tps[name]:10.0f} tokens/s")
        print(f"{label:4s} ratio packed/padded tokens/s: {tps['packed'] / tps['padded']:.2f}x (target >= 1.5)")
    print(f"max abs difference of response log-probs: {(outs['packed'] - outs['padded']).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
