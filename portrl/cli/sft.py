"""``portrl sft [--train-files F ...] [--output DIR] [--steps N] [--lr LR] [--batch-size B] [run options]``.

Supervised fine-tuning on prompt / response parquet (columns ``prompt``: chat messages, ``response``:
text, or the conversation after the prompt as chat messages, trained on its assistant messages only; `portrl
preprocess arith --sft`, `arith_tool --sft` and `wordprob --sft` write such files), packed, on every backend.
Without files and with ``data.name=arith`` (the default) it trains on generated arith rows (``arith_tool``: its
tool-call conversations; ``wordprob``: worked answers). The result is a
transformers directory (the source's config and tokenizer files, new weights: portrl.models.export), ready
for ``portrl train model.path=DIR``. Steps, learning rate and batch size default to the warm start's
(``model.sft_steps``, ``model.sft_lr``, ``model.sft_batch_size``) and, like the warm start, it ends early
once ``model.sft_target_answer_p`` is reached (the tiny preset sets 0.45; ``model.sft_target_answer_p=null``
runs every step).

Heavy modules (torch, transformers, the trainer) are imported when the command runs, so that ``portrl --help``
and ``portrl sft --help`` stay fast.
"""

from __future__ import annotations

from pathlib import Path

from portrl.cli.run_options import ExtraOption, add_run_arguments, compose_from, options_parser, parse_run_options
from portrl.errors import UserError
from portrl.outputs import ON_EXISTING, claim

PROG = "portrl sft"
EXTRA: list[ExtraOption] = [
    (("--train-files",), {"nargs": "+", "default": None, "help": "parquet files with prompt and response columns"}),
    (("--output",), {"default": None, "help": "output directory, new or empty (default: <trainer.output_dir>/sft)"}),
    (("--on-existing",), {"choices": ON_EXISTING, "default": "refuse",
                          "help": "an --output that already holds something: refuse (default) or move_aside "
                                  "(rename it to <name>.old-<time>; nothing is deleted)"}),
    (("--steps",), {"type": int, "default": None, "help": "optimizer steps (default: model.sft_steps)"}),
    (("--lr",), {"type": float, "default": None, "help": "peak learning rate (default: model.sft_lr)"}),
    (("--batch-size",), {"type": int, "default": None, "help": "examples per step (default: model.sft_batch_size)"}),
]

REST_AFTER = 0  # everything after the command is parsed by this module


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def _rows(cfg, tokenizer, files):
    if files:
        from portrl.data import SFTDataset  # noqa: PLC0415  (CLI start-up: loaded by the command)

        ds = SFTDataset(files, tokenizer, max_length=int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length))
        return [ds[i] for i in range(len(ds))]
    from portrl.trainer.resources import builtin_sft_rows  # noqa: PLC0415  (CLI start-up: loaded by the command)

    rows = builtin_sft_rows(cfg)
    if rows is None:
        from portrl.tasks import names_where  # noqa: PLC0415  (CLI start-up: loaded by the command)

        raise UserError(f"--train-files is required for data.name={cfg.data.name!r} (only "
                        f"{names_where(lambda t: t.sft_rows is not None)} is generated); give parquet files with "
                        "prompt and response columns")
    return rows


def _output(opts, cfg) -> Path:
    return Path(opts.output or Path(str(cfg.trainer.output_dir)) / "sft")


def _check_options(opts) -> None:
    """The flags' ranges, the --train-files columns and the --output path (before any model loads)."""
    if opts.steps is not None and opts.steps < 1:
        raise UserError(f"--steps {opts.steps} must be >= 1 (or leave it out: model.sft_steps)")
    if opts.lr is not None and not opts.lr > 0:
        raise UserError(f"--lr {opts.lr} must be > 0")
    if opts.batch_size is not None and opts.batch_size < 1:
        raise UserError(f"--batch-size {opts.batch_size} must be >= 1")
    if opts.train_files:
        from portrl.data.validate import check_sft_file  # noqa: PLC0415  (CLI start-up: loaded by the command)

        for f in opts.train_files:
            check_sft_file(f, "--train-files")


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Supervised fine-tuning, packed.", EXTRA), args.rest)  # --help exits
    from portrl.device import check_cli_device  # noqa: PLC0415  (CLI start-up: loaded by the command)

    check_cli_device(opts.device, opts.overrides, preset=opts.preset, config_file=opts.config)  # before torch loads
    from portrl.models import load_causal_lm, load_tokenizer  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.models.export import export_pretrained  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.tasks import builtin_sft_task  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer import run_sft  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.preflight import SFT, preflight  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.resources import resolve_model_path  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.workers.master_weights import MasterWeights, load_dtype  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.workers.setup import resolve_dtype, setup_process, use_gradient_checkpointing, worker_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)

    cfg = compose_from(opts)  # bad input here and below: a UserError, printed as one line by portrl.cli.main
    _check_options(opts)
    if not opts.train_files and builtin_sft_task(cfg) is None:
        _rows(cfg, None, None)  # the error naming --train-files
    preflight(cfg, SFT)
    out = claim(_output(opts, cfg), "--output" if opts.output else "the SFT output (--output)", opts.on_existing)
    backend = worker_backend(cfg)
    setup_process(cfg, backend)
    path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or path)
    rows = _rows(cfg, tokenizer, opts.train_files)  # tokenised before the model loads: a bad row fails fast
    dtype = resolve_dtype(cfg, backend)
    model = load_causal_lm(path, dtype=load_dtype(dtype), backend=backend, attn_impl=cfg.model.attn_impl,
                           gradient_checkpointing=use_gradient_checkpointing(cfg, path),
                           device=backend.device(None if backend.device_type == "cpu" else 0))
    master = MasterWeights(model, dtype)  # float32 masters; bf16 / fp16 compute casts the model
    steps = opts.steps or int(cfg.model.sft_steps)
    lr = float(cfg.model.sft_lr) if opts.lr is None else opts.lr
    batch_size = int(cfg.model.sft_batch_size) if opts.batch_size is None else opts.batch_size
    metrics = run_sft(cfg, model, tokenizer, rows, steps, lr, batch_size, seed=int(cfg.trainer.seed),
                      log_every=max(1, steps // 10), master=master)
    out = export_pretrained(model, out, source_dir=path, tokenizer=tokenizer,
                            tokenizer_dir=cfg.model.tokenizer_path or path, replace=False)
    stopped = "" if "sft/answer_p" not in metrics else \
        f", stopped at P(answer) {metrics['sft/answer_p']:.2f} (model.sft_target_answer_p)"
    print(f"SFT: loss {metrics['sft/loss_first']:.4f} -> {metrics['sft/loss_last']:.4f} in {metrics['sft/steps']:.0f} "
          f"steps{stopped}, {metrics['sft/time_s']:.1f}s ({metrics['sft/tokens_per_s']:.0f} tokens/s); "
          f"model written to {out}")
    return 0
