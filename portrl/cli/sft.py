"""``portrl sft [--train-files F ...] [--output DIR] [--steps N] [--lr LR] [--batch-size B] [run options]``.

Supervised fine-tuning on prompt / response parquet (columns ``prompt``: chat messages, ``response``:
text; `portrl preprocess arith --sft` writes such files), packed, on every backend. Without files
and with ``data.name=arith`` (the default) it trains on generated arith rows. The result is a
transformers directory (model + tokenizer), written to a temporary name and renamed, ready for
``portrl train model.path=DIR``. Like the warm start, it ends early once ``model.sft_target_answer_p``
is reached (the tiny preset sets 0.45; ``model.sft_target_answer_p=null`` runs every step).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from portrl.cli.run_options import add_run_arguments, compose_from, options_parser, parse_run_options

PROG = "portrl sft"
EXTRA = [
    (("--train-files",), {"nargs": "+", "default": None, "help": "parquet files with prompt and response columns"}),
    (("--output",), {"default": None, "help": "output directory (default: <trainer.output_dir>/sft)"}),
    (("--steps",), {"type": int, "default": None, "help": "optimizer steps (default: model.sft_steps)"}),
    (("--lr",), {"type": float, "default": 1e-3, "help": "peak learning rate (default 1e-3, for tiny models)"}),
    (("--batch-size",), {"type": int, "default": 32, "help": "examples per step"}),
]

REST_AFTER = 0  # everything after the command is parsed by this module


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def _rows(cfg, tokenizer, files):
    if files:
        from portrl.data import SFTDataset

        ds = SFTDataset(files, tokenizer, max_length=int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length))
        return [ds[i] for i in range(len(ds))]
    if str(cfg.data.name) != "arith":
        raise ValueError(f"{PROG}: --train-files is required for data.name={cfg.data.name!r}")
    from portrl.trainer.resources import arith_sft_rows

    return arith_sft_rows(cfg, int(cfg.data.arith.num_train))


def run(args) -> int:
    from portrl.config import ConfigError
    from portrl.device import BackendError
    from portrl.models import load_causal_lm, load_tokenizer
    from portrl.trainer import run_sft
    from portrl.trainer.resources import resolve_model_path
    from portrl.workers.master_weights import MasterWeights, load_dtype
    from portrl.workers.setup import resolve_dtype, setup_process, worker_backend

    opts = parse_run_options(options_parser(PROG, "Supervised fine-tuning, packed.", EXTRA), args.rest)
    try:
        cfg = compose_from(opts)
        backend = worker_backend(cfg)
    except (ConfigError, BackendError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    setup_process(cfg, backend)
    path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or path)
    dtype = resolve_dtype(cfg, backend)
    model = load_causal_lm(path, dtype=load_dtype(dtype), backend=backend,
                           attn_impl=cfg.model.attn_impl, gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
                           device=backend.device(None if backend.device_type == "cpu" else 0))
    master = MasterWeights(model, dtype)  # float32 masters; bf16 / fp16 compute casts the model
    try:
        rows = _rows(cfg, tokenizer, opts.train_files)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    steps = opts.steps or int(cfg.model.sft_steps)
    metrics = run_sft(cfg, model, tokenizer, rows, steps, opts.lr, opts.batch_size, seed=int(cfg.trainer.seed),
                      log_every=max(1, steps // 10), master=master)
    out = Path(opts.output or Path(str(cfg.trainer.output_dir)) / "sft")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    stopped = "" if "sft/answer_p" not in metrics else \
        f", stopped at P(answer) {metrics['sft/answer_p']:.2f} (model.sft_target_answer_p)"
    print(f"SFT: loss {metrics['sft/loss_first']:.4f} -> {metrics['sft/loss_last']:.4f} in {metrics['sft/steps']:.0f} "
          f"steps{stopped}, {metrics['sft/time_s']:.1f}s ({metrics['sft/tokens_per_s']:.0f} tokens/s); "
          f"model written to {out}")
    return 0
