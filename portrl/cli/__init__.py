"""The ``portrl`` command line: ``portrl <command> [args]``.

Each command lives in its own module ``portrl.cli.<module>`` defining ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported only when their command runs, so ``portrl --help``
stays fast. To add a command, add a line to COMMANDS.

Errors (portrl.errors): a :class:`~portrl.errors.UserError` raised by a command is printed as one line,
``portrl <command>: error: <message>``, exit code 2; ``--debug`` or ``PORTRL_DEBUG=1`` adds its traceback.
A :class:`~portrl.errors.RunStopped` prints its message and exits with its code (130 / 143). A worker that
died or stopped answering (:class:`~portrl.workers.ray_calls.WorkerDiedError`, which names the worker and the
last good checkpoint) is one line too, exit code 1. Anything else is an internal error and keeps its traceback.
Commands do not catch errors themselves.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from portrl import __version__, process_env
from portrl.errors import RunStopped, UserError

EXIT_WORKER_DIED = 1  # a worker process died or hung: the run failed, but not because of the user's input

# command -> (module under portrl.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "RL post-training (with no argument: the built-in arith demo on a tiny model)"),
    "plan": ("plan", "predict each phase's peak memory per device before a run: fits or not, and the smallest fix"),
    "sft": ("sft", "supervised fine-tuning on prompt / response parquet (packed)"),
    "eval": ("evaluate", "accuracy of a model directory or checkpoint on a dataset"),
    "devices": ("devices", "list every registered device backend and whether it can run here"),
    "doctor": ("doctor", "check the chosen backend's environment against its compatibility rows"),
    "preprocess": ("preprocess", "turn local raw datasets (gsm8k, math, dapo_math, code, any question-answer "
                                 "rows: qa) or the arith task into verl parquet"),
    "config": ("config", "print the resolved run config (defaults + presets + --config + overrides) or list presets"),
    "plot": ("plot", "write PNG curves (reward, accuracy, KL, entropy, length) from a run's metrics.jsonl"),
    "trace": ("trace", "show the decoded turns a run traced (trainer.trace_freq) in the terminal"),
    "rehearse": ("rehearse", "rehearse a cluster run's meshes and placement here (CPU processes over gloo, a shrunk "
                             "model): its first configuration or collective error before cluster time is spent"),
    "parity": ("parity", "cross-hardware parity: ops vs float64, golden record/replay, e2e envelope, compare matrix"),
}


def _command_in(argv: list[str]) -> tuple[int, str | None]:
    """(index, word) of the command: the first argument that is not an option or the value of --log-level."""
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return i, arg
    return len(argv), None


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("PORTRL_DEBUG", "") not in ("", "0")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to attach its arguments."""
    parser = argparse.ArgumentParser(prog="portrl", description="RL post-training on any accelerator.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of user errors too (same as PORTRL_DEBUG=1)")
    parser.add_argument("--version", action="version", version=f"portrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(f"portrl.cli.{module}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    # before any command imports torch, which reads them once (portrl/process_env.py: what each one does)
    process_env.apply_defaults()
    argv = list(sys.argv[1:] if argv is None else argv)
    index, command = _command_in(argv)
    parser = build_parser(command)
    # A command whose module sets REST_AFTER = k takes everything after its first k positionals unparsed
    # (``args.rest``): its own options and key=value overrides, in any order, --help included.
    rest_after = getattr(importlib.import_module(f"portrl.cli.{COMMANDS[command][0]}"), "REST_AFTER", None) \
        if command in COMMANDS else None
    if rest_after is None:
        args = parser.parse_args(argv)
    else:
        cut = index + 1 + rest_after
        args = parser.parse_args(argv[:cut])
        args.rest = argv[cut:]
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 0
    module = importlib.import_module(f"portrl.cli.{COMMANDS[args.command][0]}")
    # here, not at the top: the worker layer is imported only once a command runs (`portrl --help` stays fast)
    from portrl.workers.ray_calls import WorkerDiedError  # noqa: PLC0415  (CLI start-up: loaded by the command)

    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        if _debug(args):
            traceback.print_exc()
        print(f"portrl {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except RunStopped as exc:
        if _debug(args):
            traceback.print_exc()
        print(_one_line(exc), file=sys.stderr)
        return exc.exit_code
    except WorkerDiedError as exc:  # a worker process died or stopped answering: not the user's input, but one line
        if _debug(args):
            traceback.print_exc()
        print(f"portrl {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_WORKER_DIED
    except KeyboardInterrupt:  # Ctrl-C where a command has no handling of its own (train's: portrl.trainer.interrupts)
        if _debug(args):
            traceback.print_exc()
        print(f"portrl {args.command}: stopped by SIGINT before it finished", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    """The message on one line (a multi-line message, such as a list of config problems, is joined with '; ')."""
    parts = [p.strip() for p in str(exc).splitlines()]
    parts = [p[2:] if p.startswith("- ") else p for p in parts]
    parts = [p for p in parts if p]
    if len(parts) > 1 and parts[0].endswith(":"):
        return parts[0] + " " + "; ".join(parts[1:])
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
