"""The decode step's attention side by side in one run: torch's four ops (portrl.ops.attention.decode_attention,
the op's native implementation) and the CPU's fused kernel in each instruction-set variant this CPU runs
(backends/cpu/decode_attention.cpp), on the benchmarks' decode shapes (one query per row, a cache view of L keys).

For each shape it prints the median time per call (one layer), the cache read rate (GB/s: the keys and values read
over the time) and each kernel's speed-up over torch. Compare within one run.

    python benchmarks/decode_attention.py                 # small, medium and Qwen2.5-0.5B shapes
    python benchmarks/decode_attention.py --repeats 200
    python benchmarks/decode_attention.py --generate medium,qwen2.5-0.5b   # and whole generations, each way

``--generate``: the hf engine generates the vs_trl workload of each named configuration (random weights of its
architecture, prompt tokens drawn at random, every row to ``max_new`` tokens: no stop token) with the decoder's
attention as selected here (``fused``) and with the native op, alternating, ``--rounds`` times each; it prints the
median seconds per generation and per decode step and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import _common
from portrl.backends.cpu import isa
from portrl.backends.cpu.decode_attention import decode_attention_fused
from portrl.ops.attention import decode_attention

#: name -> (rows, query heads, KV heads, head dim, keys): the vs_trl configurations' decode steps (32 rows of 8 x 4
#: samples; Qwen2.5-0.5B: 4 x 4 rows, GSM8K prompts of ~120 tokens plus up to 128 new ones)
SHAPES = {"small": (32, 4, 2, 32, 40), "medium": (32, 8, 2, 64, 40), "qwen2.5-0.5b L=128": (16, 14, 2, 64, 128),
          "qwen2.5-0.5b L=250": (16, 14, 2, 64, 250), "64 rows, L=512": (64, 14, 2, 64, 512)}


#: --generate workloads: name -> (config fields, prompts x samples, prompt tokens, new tokens)
GENERATE = {"small": (_common.CONFIGS["small"], 8, 4, 24, 32), "medium": (_common.CONFIGS["medium"], 8, 4, 24, 32),
            "qwen2.5-0.5b": (_common.QWEN25_05B_CONFIG, 4, 4, 120, 128)}


def _model(fields: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if "vocab" in fields:  # a tiny configuration of benchmarks/_common.py: the arith vocabulary's size is enough
        fields = dict(vocab_size=64, hidden_size=fields["hidden_size"], num_hidden_layers=fields["num_layers"],
                      num_attention_heads=fields["num_heads"], num_key_value_heads=fields["num_kv_heads"],
                      intermediate_size=fields["hidden_size"] * 3, max_position_embeddings=512, eos_token_id=None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**fields)).eval()


def generate(names: list[str], rounds: int) -> None:
    """Whole generations with the fused and the native attention, alternating (module docstring)."""
    from portrl.ops import select
    from portrl.rollout import SamplingParams, make_engine

    for name in names:
        fields, prompts, samples, prompt_len, max_new = GENERATE[name]
        model = _model(dict(fields))
        engine = make_engine("hf", model=model, backend="cpu")
        decoder = engine._fast
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
        params = SamplingParams(n=samples, max_new_tokens=max_new, seed=0)
        ways = {"fused": select("decode_attention", backend="cpu")[1],
                "native": select("decode_attention", impl="native", backend="cpu")[1]}
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(rounds + 1):  # the first round warms up
            for way, fn in ways.items():
                decoder._attend = fn
                start = time.perf_counter()
                with torch.inference_mode():
                    out = engine.generate(rows, params)
                times[way].append(time.perf_counter() - start)
                assert all(len(r) == max_new for r in out.response_ids), "a row stopped early: not the workload"
        med = {w: statistics.median(t[1:]) for w, t in times.items()}
        print(f"generate {name}: {prompts} x {samples} rows, {prompt_len} prompt + {max_new} new tokens; "
              f"s per generation (ms per decode step): fused {med['fused']:.3f} ({med['fused'] / max_new * 1e3:.1f}), "
              f"native {med['native']:.3f} ({med['native'] / max_new * 1e3:.1f}); fused/native "
              f"{med['fused'] / med['native']:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--generate", default="", help=f"comma-separated, of: {', '.join(GENERATE)}")
    ap.add_argument("--rounds", type=int, default=3)
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
        base = _common.timed(lambda: decode_attention(q, k, v, hidden, D ** -0.5), args.warmup, args.repeats)
        print(f"{name} (B={B} H={H} KV={KV} D={D} L={L}), us per layer (cache GB/s, speed-up over torch):\n"
              f"  torch, keys as rows   {base * 1e6:8.1f} ({gb / base:5.1f})", flush=True)
        for label, keys in (("keys as rows", k), ("keys transposed", k_t)):
            if keys is k_t:
                t = _common.timed(lambda: decode_attention(q, keys, v, hidden, D ** -0.5), args.warmup, args.repeats)
                print(f"  torch, {label:15s}{t * 1e6:8.1f} ({gb / t:5.1f}, {base / t:4.1f}x)", flush=True)
            for variant in variants:
                t = _common.timed(lambda: decode_attention_fused(q, keys, v, hidden, D ** -0.5, variant=variant), args.warmup,
                          args.repeats)
                print(f"  {variant}, {label:15s}{t * 1e6:9.1f} ({gb / t:5.1f}, {base / t:4.1f}x)", flush=True)
    if args.generate:
        generate([n for n in args.generate.split(",") if n], args.rounds)


if __name__ == "__main__":
    main()
