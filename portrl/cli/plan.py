"""``portrl plan [--device D] [--preset P] [--config FILE] [--json] [key=value ...]``: each phase's predicted peak
memory per device, whether it fits, and the smallest change that would make it fit, before anything runs.

Reads the model's ``config.json`` only (no weights: a 72B config plans on a laptop), the mesh, the dtype, the
micro-batch tokens and the device's memory (``device.memory_gib``, set by each device preset; else what this
machine's backend reports). The sizes are the config's worst step (portrl/plan/run_plan.py); the formulas are
portrl/plan/memory.py's.
"""

from __future__ import annotations

import json
from typing import Optional

from portrl.cli.run_options import add_run_arguments, compose_from, options_parser, parse_run_options

PROG = "portrl plan"
REST_AFTER = 0
#: terms named per phase in the table, largest first
SHOWN_TERMS = 4


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def device_memory(cfg, world: int) -> tuple[Optional[int], str]:
    """(bytes one device holds or None, where the figure came from): the preflight's figure
    (portrl.trainer.memory_plan.device_memory) where this machine has the backend's device, else
    ``device.memory_gib`` alone."""
    if cfg.device.memory_gib is not None:
        return int(float(cfg.device.memory_gib) * 2**30), "device.memory_gib"
    from portrl.device.registry import detect, get_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer import memory_plan  # noqa: PLC0415  (CLI start-up: loaded by the command)

    try:
        backend = detect() if str(cfg.device.name) == "auto" else get_backend(str(cfg.device.name))
        memory = memory_plan.device_memory(cfg, backend, world) if backend.probe().usable else None
    except Exception:  # noqa: BLE001  (no device of that backend here: the plan says the memory is unknown)
        memory = None
    return memory, "this machine's" if memory is not None else "unknown"


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Predict each phase's peak memory per device.",
                                            [(("--json",), dict(action="store_true",
                                                                help="print the plan as JSON"))]), args.rest)
    cfg = compose_from(opts)
    from portrl.plan.fit import smallest_fix  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.plan.run_plan import GIB, plan_run  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.models.loader import check_model_dir  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.data_fit import fit_token_budget  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.memory_plan import policy_shape, resolve_auto_budget  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if cfg.model.path:
        check_model_dir(str(cfg.model.path), "model.path")  # one line for a folder that is not a model's
    shape = policy_shape(cfg)
    fit_token_budget(cfg)  # a null budget sized by the model, as `portrl train` sizes it
    world = int(cfg.trainer.num_workers or 1)
    memory, source = device_memory(cfg, world)
    auto = cfg.actor.max_tokens_per_micro_batch == "auto"
    if auto:  # the largest the plan fits
        resolve_auto_budget(cfg, shape, world, memory)
    plan = plan_run(cfg, shape, world, memory)
    fix = smallest_fix(cfg, shape, world, memory) if plan.fits is False and memory else None
    if opts.json:
        print(json.dumps({**plan.as_dict(), "memory_source": source, "world": world, "params": shape.params,
                          "smallest_fix": fix, "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch},
                         indent=2))
        return 0
    if auto:
        print(f"actor.max_tokens_per_micro_batch=auto -> {cfg.actor.max_tokens_per_micro_batch} tokens")
    print(f"{PROG}: {shape.model_type}, {shape.params / 1e6:,.1f}M parameters, {world} device(s), "
          f"{'%.1f GiB' % (memory / GIB) if memory else 'unknown memory'} per device ({source})")
    for p in plan.phases:
        terms = sorted(p.terms.items(), key=lambda kv: -kv[1])[:SHOWN_TERMS]
        print(f"  {p.phase:14s} {p.bytes / GIB:8.2f} GiB  " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in terms))
    peak = plan.peak
    verdict = {True: "fits", False: "does not fit", None: "fit unknown (set device.memory_gib)"}[plan.fits]
    advice = (f"; smallest change that fits: {fix}" if fix else "; no single change of micro-batch tokens, "
              "checkpointing, rollout share or sequence parallelism fits") if plan.fits is False else ""
    print(f"peak: {peak.phase} {peak.bytes / GIB:.2f} GiB per device: {verdict}{advice}")
    return 0
