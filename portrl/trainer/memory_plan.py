"""The memory plan in a run: the preflight refuses a run predicted not to fit (portrl/plan/fit.py), and every step
logs what the plan predicts of that step beside what it measured.

* :func:`check_memory_plan` (preflight, its last check, before a model loads): the plan of the config's worst
  step against the device's memory, ``device.memory_gib`` or the backend's available memory (on the CPU the
  host's physical memory, shared by the run's workers: each gets its share). One line and exit 2 when a phase
  does not fit, naming the phase, predicted against available and the change that fits;
  ``trainer.memory_check=false`` goes on anyway.
* :func:`fit_auto_token_budget`: ``actor.max_tokens_per_micro_batch=auto`` resolved to the largest budget the
  plan fits.
* :class:`StepPlan` (the trainer, where its workers run in its process and memory is measured): per step,
  ``memory/plan_gib/<phase>`` for each measured ``memory/peak_gib/<phase>``, the plan evaluated at the step's
  own sizes (its prompts, its longest prompt and response).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Optional

from portrl.device.backend import Backend
from portrl.plan.fit import check_fits, largest_token_budget
from portrl.plan.run_plan import GIB, Device, compacted, mesh_of, plan_run, workload_of_batch
from portrl.plan.shape import ModelShape, shape_of_folder, tiny_shape
from portrl.errors import UserError
from portrl.trainer.data_fit import note_once, writable
from portrl.trainer.mesh_check import model_dims
from portrl.workers.setup import auto_num_workers, resolve_dtype

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: a plan phase -> the trainer's Timer phases it predicts
MEASURED_AS = {"gen": ("gen",), "logp": ("old_log_prob",), "ref": ("ref",), "update_actor": ("update_actor",),
               "values": ("values",), "update_critic": ("update_critic",)}


def device_memory(cfg: PortRLConfig, backend: Backend, world: int) -> Optional[int]:
    """Bytes one device holds for the run: ``device.memory_gib``, else the backend's available memory; on the CPU
    the host's physical memory divided among the run's ``world`` workers (its available memory moves with every
    other process: a check against it would refuse a run by chance). None when nothing is known."""
    if cfg.device.memory_gib is not None:
        return int(float(cfg.device.memory_gib) * GIB)
    if backend.device_type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
        except (ValueError, OSError, AttributeError):  # no such figure on this system
            return None
    return backend.memory_available()


def policy_shape(cfg: PortRLConfig) -> ModelShape:
    """The policy's shape from ``model.path``'s config.json, or the built-in tiny model's from ``model.tiny``
    without writing it (a run refused before it starts writes nothing)."""
    if cfg.model.path:
        return shape_of_folder(str(cfg.model.path))
    t, dims = cfg.model.tiny, model_dims(cfg, None)
    return tiny_shape(int(t.hidden_size), int(t.num_layers), int(t.num_heads), int(t.num_kv_heads),
                      int(t.intermediate_size), int(dims["vocab_size"]))


def device_of(cfg: PortRLConfig, backend: Backend) -> Device:
    """The run's training dtype and whether its device is the host, as the backend answers."""
    return Device(dtype=resolve_dtype(cfg, backend), host=backend.device_type == "cpu")


def run_world(cfg: PortRLConfig, backend: Backend) -> int:
    return int(cfg.trainer.num_workers) if cfg.trainer.num_workers is not None else auto_num_workers(cfg, backend)[0]


def check_memory_plan(cfg: PortRLConfig, backend: Backend) -> None:
    """The preflight's check (module docstring); logs the predicted peak when it fits."""
    if cfg.reward_model.enable or cfg.rollout.placement != "colocated":
        return  # the PRM's and separated rollout workers' memory are not in the plan yet (docs/performance.md)
    shape = policy_shape(cfg)
    world = run_world(cfg, backend)
    memory = device_memory(cfg, backend, world)
    plan = check_fits(cfg, shape, world, memory, device_of(cfg, backend))
    note_once(cfg, f"memory plan: peak {plan.peak.phase} {plan.peak.bytes / GIB:.2f} GiB per device of "
                   f"{'unknown' if memory is None else f'{memory / GIB:.1f} GiB'} (portrl plan shows every phase)")


def fit_auto_token_budget(cfg: PortRLConfig, backend: Backend) -> None:
    """``actor.max_tokens_per_micro_batch=auto`` resolved for this machine's devices (:func:`resolve_auto_budget`)."""
    if cfg.actor.max_tokens_per_micro_batch == "auto":
        world = run_world(cfg, backend)
        resolve_auto_budget(cfg, policy_shape(cfg), world, device_memory(cfg, backend, world),
                            device_of(cfg, backend))


def resolve_auto_budget(cfg: PortRLConfig, shape: ModelShape, world: int, memory: Optional[int],
                        device: Device = Device()) -> None:
    """``actor.max_tokens_per_micro_batch=auto`` becomes the largest budget the plan fits in ``memory`` bytes per
    device (portrl.plan.fit.largest_token_budget), said in one note; UserError (one line) without a memory
    figure, or when not even one prompt's rows fit."""
    if memory is None:
        raise UserError("actor.max_tokens_per_micro_batch=auto needs the device's memory, and none is known: set "
                        "device.memory_gib (GiB per device; every device preset sets it) or give a number of tokens")
    budget = largest_token_budget(cfg, shape, world, memory, device)
    if budget is None:
        raise UserError(f"actor.max_tokens_per_micro_batch=auto: not even one prompt's rows fit the memory plan in "
                        f"{memory / GIB:.1f} GiB per device (see `portrl plan`); use more devices, shorter "
                        "responses (data.max_response_length) or a smaller model")
    with writable(cfg.actor):
        cfg.actor.max_tokens_per_micro_batch = budget
    note_once(cfg, f"actor.max_tokens_per_micro_batch=auto -> {budget} tokens per micro-batch: the largest the "
                   f"memory plan fits in {memory / GIB:.1f} GiB per device")


class StepPlan:
    """The plan of each step's sizes, for the trainer's ``memory/plan_gib/<phase>`` metrics."""

    def __init__(self, cfg: PortRLConfig, backend: Backend, world: int):
        self.cfg, self.world, self.device = cfg, world, device_of(cfg, backend)
        self.shape: ModelShape = shape_of_folder(str(cfg.model.path))

    def metrics(self, batch: Any, measured: Dict[str, float]) -> Dict[str, float]:
        """``memory/plan_gib/<phase>`` for each phase of ``measured`` (a step's metrics) the plan predicts."""
        t = batch.tensors
        prompts = len(set(batch.meta["uid"])) if "uid" in batch.meta else len(t["responses"]) // int(self.cfg.rollout.n)
        prompt_len = int(t["attention_mask"][:, : -t["responses"].shape[1]].sum(-1).max())
        lengths = t["response_mask"].sum(-1).tolist()
        compacts = compacted(lengths, int(self.cfg.data.max_response_length))
        w = workload_of_batch(self.cfg, mesh_of(self.cfg, self.world), prompts, prompt_len, int(max(lengths)),
                              compacts)
        out = {}
        for phase in plan_run(self.cfg, self.shape, self.world, None, w, self.device).phases:
            for name in MEASURED_AS[phase.phase]:
                if f"memory/peak_gib/{name}" in measured:
                    out[f"memory/plan_gib/{name}"] = phase.bytes / GIB
        return out
