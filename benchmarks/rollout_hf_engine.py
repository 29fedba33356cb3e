"""Tokens/s of the ``hf`` rollout engine against ``model.generate`` on the same tiny model, side by side.

    python benchmarks/rollout_hf_engine.py [--prompts 16] [--n 4] [--max-new 64] [--repeats 3]

Two workloads: every row runs to ``max_new`` tokens ("no stop"), and rows stop early on any of
8 EOS ids ("early stops", response lengths vary as in RL). ``model.generate`` runs with
``do_sample=True`` and no scores (the cheapest way to call it, so the ratio is conservative:
the engine also returns log-probs), with the dynamic and with the static KV cache.
Tokens counted: generated tokens up to and including the stop token.
"""

from __future__ import annotations

import argparse
import time

import torch


def tiny_model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=hidden * 2, max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def count_generate_tokens(seqs: torch.Tensor, prompt_len: int, eos: set[int]) -> int:
    total = 0
    for row in seqs[:, prompt_len:].tolist():
        k = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        total += k
    return total


def run_generate(model, prompts, n, max_new, eos, cache_impl):
    from portrl.rollout.engine import check_prompts

    prompts = check_prompts(prompts)
    plen = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), plen, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p):] = torch.tensor(p)
        mask[i, plen - len(p):] = 1
    kw = {"cache_implementation": "static"} if cache_impl == "static" else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_new, num_return_sequences=n, eos_token_id=sorted(eos), pad_token_id=0, **kw,
        )
    dt = time.perf_counter() - t0
    return count_generate_tokens(out, plen, eos), dt


def run_engine(engine, prompts, n, max_new, seed):
    from portrl.rollout import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=max_new, seed=seed))
    return out.num_tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from portrl.rollout import make_engine

    model = tiny_model(args.hidden, args.layers, args.vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, args.vocab, (int(torch.randint(12, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    print(f"model: Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
          f"{args.prompts} prompts x n={args.n}, max_new={args.max_new}, threads={torch.get_num_threads()}")
    for label, eos in (("no stop", {1}), ("early stops", set(range(1, 9)) | set(range(100, 100 + args.vocab // 40)))):
        model.generation_config.eos_token_id = sorted(eos)
        engine = make_engine("hf", model=model, backend="cpu")
        results = {}
        runs = {
            "hf engine": lambda i: run_engine(engine, prompts, args.n, args.max_new, seed=i),
            "generate (dynamic cache)": lambda i: run_generate(model, prompts, args.n, args.max_new, eos, "dynamic"),
            "generate (static cache)": lambda i: run_generate(model, prompts, args.n, args.max_new, eos, "static"),
        }
        for name, fn in runs.items():
            fn(0)  # warm-up
        for i in range(args.repeats):  # interleaved so that machine load hits every contender alike
            for name, fn in runs.items():
                tok, dt = fn(i + 1)
                results.setdefault(name, [0, 0.0])
                results[name][0] += tok
                results[name][1] += dt
        base = results["generate (dynamic cache)"][0] / results["generate (dynamic cache)"][1]
        print(f"\n[{label}]")
        for name, (tok, dt) in results.items():
            rate = tok / dt
            print(f"  {name:26s} {rate:10.0f} tokens/s   x{rate / base:5.2f} vs generate (dynamic)   ({tok} tokens)")


if __name__ == "__main__":
    main()
