"""``portrl train [--device D] [--preset P] [--config FILE] [key=value ...]``: RL training.

With no argument on a CPU machine this is the built-in demo: a tiny Qwen2 model (cached under
~/.cache/portrl), a short SFT warm start on the arith task, then GRPO on arith, ending with a
summary (accuracy before and after, time, tokens/s, the run directory and the plot).

Heavy modules (torch, transformers, the trainer) are imported when the command runs, so that ``portrl --help``
and ``portrl train --help`` stay fast.
"""

from __future__ import annotations

from portrl.cli.run_options import add_run_arguments, compose_from, options_parser, parse_run_options

PROG = "portrl train"

REST_AFTER = 0  # everything after the command is parsed by this module


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def format_summary(summary: dict) -> str:
    """The end-of-run summary as aligned lines."""
    def pct(v):
        return "n/a" if v is None else f"{100 * float(v):.1f}%"

    lines = ["", "== portrl run summary =="]
    if summary.get("resumed_from"):
        lines.append(f"resumed from       {summary['resumed_from']}")
    if "sft/loss_first" in summary:
        stopped = "" if "sft/answer_p" not in summary else f", stopped at P(answer) {summary['sft/answer_p']:.2f}"
        lines.append(f"SFT warm start     loss {summary['sft/loss_first']:.3f} -> {summary['sft/loss_last']:.3f} "
                     f"in {summary.get('sft/steps', 0):.0f} steps{stopped}, {summary.get('sft/time_s', 0):.0f}s")
    if "critic/pretrain_steps" in summary:
        lines.append(f"value pretraining  {summary['critic/pretrain_steps']:.0f} steps, explained variance "
                     f"{summary['critic/pretrain_ev']:.2f}, {summary['critic/pretrain_time_s']:.0f}s")
    before, after = summary.get("val_before"), summary.get("val_after")
    before_rl = summary.get("val_before_rl")
    gain = "" if before is None or after is None else f"  ({100 * (after - before):+.1f} points)"
    if before_rl is not None and "sft/loss_first" in summary:  # the untrained model, after SFT, after RL
        rl_gain = "" if after is None else f"  ({100 * (after - before_rl):+.1f} points from RL)"
        lines.append(f"validation acc     {pct(before)} untrained -> {pct(before_rl)} after SFT "
                     f"-> {pct(after)} after RL{gain}")
        lines.append(f"RL gain            {pct(before_rl)} -> {pct(after)}{rl_gain}")
    else:
        lines.append(f"validation acc     {pct(before)} -> {pct(after)}{gain}")
    lines.append(f"RL steps           {summary.get('steps')}")
    lines.append(f"time               {summary.get('time_s', 0):.1f}s")
    tps = summary.get("tokens_per_s")
    lines.append(f"tokens/s           {'n/a' if tps is None else f'{tps:.0f}'}")
    for line in summary.get("speed") or []:  # a stage more than 2x off its roofline (portrl.trainer.speed)
        lines.append(f"speed              {line}")
    lines.append(f"run directory      {summary.get('run_dir')}")
    for plot in summary.get("plots") or []:
        lines.append(f"plot               {plot}")
    if summary.get("export_dir"):
        lines.append(f"policy (HF format) {summary['export_dir']}")
    return "\n".join(lines)


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "RL post-training."), args.rest)  # --help exits here
    from portrl.device import check_cli_device  # noqa: PLC0415  (CLI start-up: loaded by the command)

    check_cli_device(opts.device, opts.overrides, preset=opts.preset, config_file=opts.config)  # before torch loads
    cfg = compose_from(opts)  # bad input: a UserError, printed as one line by portrl.cli.main
    from portrl.trainer import run_training  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.preflight import TRAIN, preflight  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.resources import settle_config  # noqa: PLC0415  (CLI start-up: loaded by the command)

    preflight(cfg, TRAIN)  # everything that can be checked before a model loads
    summary = run_training(settle_config(cfg))  # resources resolved, then read-only
    print(format_summary(summary))
    return 0
