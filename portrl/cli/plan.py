"""``portrl plan [--device D] [--preset P] [--config FILE] [--json] [key=value ...]``: each phase's predicted peak
memory per device, whether it fits, the smallest change that would make it fit, and the step's time floor at the
device's peaks (portrl/plan/step_time.py), before anything runs.

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


def step_floor_of(cfg, shape, world: int):
    """(the worst step's time floor on one device or None, the peaks' source or why there is none): the backend's
    peak table for ``device.model`` (the CPU measures its own)."""
    from portrl.device.registry import detect, get_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.plan.memory import DTYPE_BYTES  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.plan.run_plan import checkpointing_on, mesh_of, on_host, run_dtype, workload_of_config  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.plan.step_time import step_floor  # noqa: PLC0415  (CLI start-up: loaded by the command)

    backend = detect() if str(cfg.device.name) == "auto" else get_backend(str(cfg.device.name))
    if backend.device_type != "cpu" and not cfg.device.model:
        return None, "no device.model to read the peak table by (a device preset sets it)"
    dtype = run_dtype(cfg, on_host(cfg))
    peak = backend.peak_throughput(dtype, cfg.device.model or None)
    if peak is None:
        return None, f"no peak figure for device.model={cfg.device.model} in {dtype}"
    w = workload_of_config(cfg, mesh_of(cfg, world))
    return step_floor(cfg, shape, w, peak, DTYPE_BYTES[dtype], checkpointing_on(cfg, shape)), peak.source


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Predict each phase's peak memory per device.",
                                            [(("--json",), dict(action="store_true",
                                                                help="print the plan as JSON"))]), args.rest)
    cfg = compose_from(opts)
    from portrl.plan.fit import smallest_fix  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.plan.run_plan import plan_run  # noqa: PLC0415  (CLI start-up: loaded by the command)
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
    floor, peaks = step_floor_of(cfg, shape, world)
    if opts.json:
        print(json.dumps({**plan.as_dict(), "memory_source": source, "world": world, "params": shape.params,
                          "smallest_fix": fix, "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch,
                          "step_floor_s": None if floor is None else {"update": floor.update_s,
                                                                      "rollout": floor.rollout_s,
                                                                      "rollout_bound": floor.rollout_bound},
                          "peaks": peaks}, indent=2))
        return 0
    if auto:
        print(f"actor.max_tokens_per_micro_batch=auto -> {cfg.actor.max_tokens_per_micro_batch} tokens")
    print_plan(plan, shape, world, memory, source, fix)
    print(f"step time floor at the device's peaks ({peaks}): " + (
        "none" if floor is None else f"update >= {floor.update_s:.3g} s, rollout >= {floor.rollout_s:.3g} s "
                                     f"(bound by {floor.rollout_bound})"))
    return 0


def print_plan(plan, shape, world: int, memory: Optional[int], source: str, fix: Optional[str]) -> None:
    """The plan as text: the phases with their largest terms, the peak, whether it fits, the change that would."""
    gib = 2**30
    print(f"{PROG}: {shape.model_type}, {shape.params / 1e6:,.1f}M parameters, {world} device(s), "
          f"{'%.1f GiB' % (memory / gib) if memory else 'unknown memory'} per device ({source})")
    for p in plan.phases:
        terms = sorted(p.terms.items(), key=lambda kv: -kv[1])[:SHOWN_TERMS]
        print(f"  {p.phase:14s} {p.bytes / gib:8.2f} GiB  " + ", ".join(f"{k} {v / gib:.2f}" for k, v in terms))
    peak = plan.peak
    verdict = {True: "fits", False: "does not fit", None: "fit unknown (set device.memory_gib)"}[plan.fits]
    advice = (f"; smallest change that fits: {fix}" if fix else "; no single change of micro-batch tokens, "
              "checkpointing, rollout share or sequence parallelism fits") if plan.fits is False else ""
    print(f"peak: {peak.phase} {peak.bytes / gib:.2f} GiB per device: {verdict}{advice}")
