"""Training forward + backward of GRPO-shaped batches: each prompt once (shared) vs once per sample (packed).

Same tiny Qwen2 model, same batch: ``--prompts`` prompts x ``--samples`` responses each, prompt
lengths spread over [P/2, P], response lengths over [1, T] (verl layout). Both sides run
``compute_logprobs`` (log-probs + entropy) and backward, packed through portrl's varlen attention:

* packed: padding removed, every row a sequence (its prompt runs once per sample);
* shared: rows with equal prompts share one copy (``share_prompts=True``, portrl.models.prefix_sharing).

The sides alternate in one process; median of ``--repeats``, by wall clock and by this process's
CPU time. Prints the tokens each side runs, the speed-up shared/packed and the max abs difference
of the log-probs and of one weight gradient.

    python benchmarks/shared_prompts.py [--prompts 8] [--samples 4] [--prompt-len 24] [--response-len 32]
                                        [--hidden 512] [--layers 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def make_batch(prompts: int, samples: int, prompt_len: int, response_len: int, seed: int = 0):
    """``prompts * samples`` rows, prompt-major; left-padded prompts, right-padded responses."""
    import torch

    g = torch.Generator().manual_seed(seed)
    P, T = prompt_len, response_len
    ids = torch.full((prompts * samples, P + T), 256, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(prompts):
        p = int(torch.randint(max(1, P // 2), P + 1, (1,), generator=g))
        prompt = torch.randint(0, 256, (p,), generator=g)
        for j in range(samples):
            b = i * samples + j
            r = int(torch.randint(1, T + 1, (1,), generator=g))
            ids[b, P - p:P], mask[b, P - p:P] = prompt, 1
            ids[b, P:P + r], mask[b, P:P + r] = torch.randint(0, 256, (r,), generator=g), 1
    return ids, mask, T


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)

    from portrl.models import compute_logprobs, load_causal_lm, write_tiny_model
    from portrl.models.prefix_sharing import plan_shared_prompts

    with tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        path = write_tiny_model(tmp + "/model", hidden_size=a.hidden, num_layers=a.layers,
                                num_heads=max(1, a.hidden // 64), num_kv_heads=max(1, a.hidden // 256))
        model = load_causal_lm(path, backend="cpu")
    ids, mask, T = make_batch(a.prompts, a.samples, a.prompt_len, a.response_len)
    tokens = {"packed": int(mask.sum()), "shared": plan_shared_prompts(ids, mask, T).flat_ids.numel()}

    def step(name):
        model.zero_grad(set_to_none=True)
        logp, ent = compute_logprobs(model, ids, mask, T, with_entropy=True, share_prompts=name == "shared")
        (logp.sum() + 0.01 * ent.sum()).backward()
        return logp.detach(), model.model.layers[0].self_attn.k_proj.weight.grad.clone()

    outs = {name: step(name) for name in tokens}  # warm-up
    wall = {name: [] for name in tokens}
    cpu = {name: [] for name in tokens}
    for _ in range(a.repeats):
        for name in tokens:
            t0, c0 = time.perf_counter(), time.process_time()
            step(name)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    print(f"{a.prompts} prompts x {a.samples} samples, prompt <= {a.prompt_len}, response <= {a.response_len} tokens; "
          f"hidden={a.hidden} layers={a.layers} threads={a.threads}")
    for name in tokens:
        print(f"{name:7s} runs {tokens[name]:6d} tokens   wall {statistics.median(wall[name]):7.3f} s/step   "
              f"cpu {statistics.median(cpu[name]):7.3f} s/step")
    for label, times in (("wall", wall), ("cpu", cpu)):
        print(f"{label:4s} speed-up shared/packed: {statistics.median(times['packed']) / statistics.median(times['shared']):.2f}x")
    print(f"max abs difference: log-probs {(outs['shared'][0] - outs['packed'][0]).abs().max().item():.2e}, "
          f"layer-0 k_proj gradient {(outs['shared'][1] - outs['packed'][1]).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
