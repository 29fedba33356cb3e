"""``portrl config show [--device D] [--preset P] [--config FILE] [overrides...]``: the resolved config as YAML.

After the YAML, comment lines name the keys that more than one layer set and where each value came from
(``rollout.n: 2 (configs/algorithm/spin.yaml, keep); configs/model/tiny.yaml set 8 (held off by keep)``).
``portrl config list`` prints the shipped presets of each group. Overrides are ``key=value``
(dotted keys, or ``algorithm=`` / ``data=`` / ``model=`` / ``device=`` / ``preset=`` to pick presets).

Heavy modules are imported when the command runs, so that ``portrl --help`` and ``portrl config list``
stay fast (``list`` reads only the preset file names; ``show`` composes a config with omegaconf).
"""

from __future__ import annotations

import argparse
import sys


def _options_parser(prog: str = "portrl config show"):
    p = argparse.ArgumentParser(prog=prog, description="Print the resolved run config as YAML.")
    p.add_argument("--device", default=None, help="backend name (see `portrl devices`; or auto) or a device preset")
    p.add_argument("--preset", default=None, help="device preset (configs/device; `portrl config list`), e.g. h100")
    p.add_argument("--config", default=None, help="a YAML file merged after the presets")
    p.add_argument("--no-check", action="store_true", help="skip validation against registries and the backend")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm=dapo actor.clip_ratio_high=0.3")
    return p

REST_AFTER = 1  # everything after the command and its action is parsed by this module


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["show", "list"], help="show: print the resolved config; list: the presets")
    # Options and key=value overrides may be interleaved, which one argparse pass cannot parse: the rest
    # of the line is parsed by _options_parser() (see `portrl config show --help`).
    parser.add_argument("rest", nargs=argparse.REMAINDER,
                        help="[--device D] [--preset P] [--config FILE] [--no-check] [key=value ...]")


def run(args) -> int:
    from portrl.config.presets import GROUPS, list_presets  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if args.action == "list":
        for group in GROUPS:
            print(f"{group}: {', '.join(list_presets(group))}")
        return 0
    opts = _options_parser().parse_intermixed_args(args.rest)  # before the import: `config show --help` stays fast
    from portrl.config.composition import compose, key_origins, to_yaml  # noqa: PLC0415  (CLI start-up: loaded by the command)

    cfg = compose(device=opts.device, preset=opts.preset, config_file=opts.config,
                  overrides=opts.overrides, check=not opts.no_check)
    sys.stdout.write(to_yaml(cfg))
    sys.stdout.write(origins_comment(key_origins(cfg)))
    return 0


def origins_comment(origins) -> str:
    """YAML comment lines (empty when none) naming, for each key that more than one layer set (presets, --config,
    overrides, a derived value), where its value came from and what the others set (portrl/config/preset_layers.py
    states the precedence)."""
    lines = origins.describe() if origins is not None else []
    if not lines:
        return ""
    head = ("# keys set by more than one layer, the value that holds first (later wins: presets device < algorithm <"
            "\n# data < model, except a key a preset keeps; then --config; then key=value, which always wins):")
    return "\n".join([head, *(f"#   {line}" for line in lines)]) + "\n"
