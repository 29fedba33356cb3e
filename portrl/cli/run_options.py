"""Options shared by the commands that build a run config (train, sft, eval, config show).

``[--device D] [--preset P] [--config FILE] [key=value ...]``: options and overrides may be
interleaved, which one argparse pass with subparsers cannot parse, so the command keeps the rest of
the line and parses it here.

The config composition (omegaconf) is imported when a config is built, so that ``portrl <command> --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Attach the catch-all that :func:`parse_run_options` reads."""
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="[--device D] [--preset P] [--config FILE] [key=value ...] (see --help of the command)")


#: one extra option of a command: (the names, the keywords) of ``ArgumentParser.add_argument``
ExtraOption = tuple[tuple[str, ...], dict[str, Any]]


def options_parser(prog: str, description: str, extra: Sequence[ExtraOption] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--device", default=None, help="backend name (portrl devices) or auto; a device preset name also works")
    p.add_argument("--preset", default=None, help="device preset (configs/device), see `portrl config list`")
    p.add_argument("--config", default=None, help="a YAML file merged after the presets")
    for args, kwargs in extra:
        p.add_argument(*args, **kwargs)
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm=dapo actor.optim.lr=1e-6")
    return p


def parse_run_options(parser: argparse.ArgumentParser, rest: list[str]) -> argparse.Namespace:
    return parser.parse_intermixed_args(rest)


def compose_from(opts: argparse.Namespace, extra_overrides: Sequence[str] = ()):
    """The composed, validated config of a command line (ConfigError on bad input)."""
    from portrl.config import compose  # noqa: PLC0415  (CLI start-up: loaded by the command)

    return compose(device=opts.device, preset=opts.preset, config_file=opts.config,
                   overrides=[*opts.overrides, *extra_overrides])
