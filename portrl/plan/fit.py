"""Whether a run fits its devices' memory, and the smallest change that would make it fit.

The changes tried, each alone, in this order (the first that fits is the answer): gradient checkpointing on;
the micro-batch token budget halved until it fits (not below one prompt's group of rows); the rollout engine's
share of the device lowered (an engine that reserves memory up front); an offload lever (AdamW's moments, the
float32 weights, the reference, the activations: an accelerator's only); sequence parallelism doubled while the
devices allow. None fits: the plan says so and names the phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, cast

from omegaconf import OmegaConf

from portrl.errors import UserError
from portrl.plan.run_plan import GIB, Device, RunPlan, plan_run
from portrl.plan.shape import ModelShape

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: the smallest token budget the search offers
MIN_TOKEN_BUDGET = 256
#: ``auto`` budgets fit the plan in this share of the memory: the plan's error on measured peaks is within 15 %
AUTO_HEADROOM = 0.85


def _with(cfg: PortRLConfig, key: str, value: object) -> PortRLConfig:
    out = OmegaConf.create(cast(dict, OmegaConf.to_container(cfg, resolve=False)))  # the run's config: read-only
    OmegaConf.update(out, key, value, merge=False)
    return out  # type: ignore[return-value]


def _candidates(cfg: PortRLConfig, shape: ModelShape, world: int) -> Iterator[tuple[str, object]]:
    if not cfg.model.gradient_checkpointing:
        yield "model.gradient_checkpointing", True
    budget = cfg.actor.max_tokens_per_micro_batch
    group = int(cfg.data.max_prompt_length) + int(cfg.rollout.n) * int(cfg.data.max_response_length)
    start = int(budget) if budget else group * max(1, int(cfg.actor.ppo_micro_batch_size_per_device) //
                                                    max(1, int(cfg.rollout.n)))
    tokens = start // 2
    while tokens >= max(MIN_TOKEN_BUDGET, group):
        yield "actor.max_tokens_per_micro_batch", tokens
        tokens //= 2
    util = float(cfg.rollout.gpu_memory_utilization)
    for lower in (0.5, 0.4, 0.3):
        if lower < util:
            yield "rollout.gpu_memory_utilization", lower
    a = cfg.actor.offload
    levers = {"actor.offload.optimizer": a.optimizer, "actor.offload.params": a.params,
              "ref.param_offload": cfg.ref.param_offload, "actor.offload.activations": a.activations}
    for key, on in levers.items():
        if not on:
            yield key, True
    sp = int(cfg.actor.sequence_parallel_size) * 2
    while sp * int(cfg.actor.tensor_parallel_size) <= world and shape.heads % sp == 0:
        yield "actor.sequence_parallel_size", sp
        sp *= 2


def smallest_fix(cfg: PortRLConfig, shape: ModelShape, world: int, memory: int,
                 device: Device = Device()) -> Optional[str]:
    """``key=value`` of the first change of the module docstring's list that makes every phase fit, else None."""
    for key, value in _candidates(cfg, shape, world):
        try:
            if plan_run(_with(cfg, key, value), shape, world, memory, device=device).fits:
                return f"{key}={value}"
        except ValueError:  # a mesh these devices cannot form
            continue
    return None


def refusal(plan: RunPlan, fix: Callable[[], Optional[str]]) -> Optional[str]:
    """The one line refusing a plan that does not fit (None when it fits or the memory is unknown)."""
    if plan.fits is not False or plan.device_memory is None:
        return None
    peak = plan.peak
    change = fix()
    how = f"{change} fits" if change else "no single change of micro-batch tokens, checkpointing, rollout share, " \
                                          "offload or sequence parallelism fits: use more devices or a smaller model"
    return (f"the memory plan predicts phase {peak.phase} needs {peak.bytes / GIB:.2f} GiB per device, more than "
            f"the {plan.device_memory / GIB:.2f} GiB available; {how} (see `portrl plan`; "
            "trainer.memory_check=false runs anyway)")


def check_fits(cfg: PortRLConfig, shape: ModelShape, world: int, memory: Optional[int],
               device: Device = Device()) -> RunPlan:
    """The run's plan; UserError (one line: the phase, predicted against available, the change that fits) when
    it does not fit and ``trainer.memory_check`` is on."""
    plan = plan_run(cfg, shape, world, memory, device=device)
    if bool(cfg.trainer.memory_check):
        line = refusal(plan, lambda: smallest_fix(cfg, shape, world, memory or 0, device))
        if line:
            raise UserError(line)
    return plan


def largest_token_budget(cfg: PortRLConfig, shape: ModelShape, world: int, memory: int,
                         device: Device = Device()) -> Optional[int]:
    """The largest ``actor.max_tokens_per_micro_batch`` (a multiple of 256, at least one prompt's group of rows,
    at most a no-grad micro-batch's rows) whose plan fits AUTO_HEADROOM of ``memory`` bytes per device; None when
    even the smallest does not."""
    n = int(cfg.rollout.n)
    group = int(cfg.data.max_prompt_length) + n * int(cfg.data.max_response_length)
    prompts = -(-int(cfg.data.train_batch_size) // max(1, world))
    # beyond a no-grad micro-batch's rows (4 x ppo_micro_batch_size_per_device) a larger budget changes nothing
    groups = min(prompts, -(-4 * int(cfg.actor.ppo_micro_batch_size_per_device) // n))
    low, high = -(-group // 256), max(-(-group // 256), -(-groups * group // 256))  # in units of 256 tokens

    room = int(memory * AUTO_HEADROOM)

    def fits(units: int) -> bool:
        budget = _with(cfg, "actor.max_tokens_per_micro_batch", units * 256)
        return bool(plan_run(budget, shape, world, room, device=device).fits)

    if not fits(low):
        return None
    while low < high:  # the largest that fits: fits(low) holds throughout
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * 256
