"""A run's memory plan from its config: the sizes one device handles (:class:`~portrl.plan.memory.Workload`), how it
holds its models (:class:`~portrl.plan.memory.Layout`), each phase's peak, whether it fits the device's memory,
and the smallest change that makes it fit.

The preflight's sizes are the config's maxima (every prompt ``data.max_prompt_length`` tokens, every response
``data.max_response_length``): the worst step the run can meet. A running step's are its batch's
(:func:`workload_of_batch`), so the trainer logs what the plan says of the step it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from portrl.algo.spec import critic_enabled, reference_enabled
from portrl.device.mesh_shape import MeshShape
from portrl.plan.memory import DTYPE_BYTES, Layout, PhasePeak, Workload, lora_params, plan_phases, tape_bytes
from portrl.plan.shape import ModelShape
from portrl.rollout.decode_rows import COMPACT_FRACTION
from portrl.rollout.fast_decode import SUPPORTED_MODEL_TYPES as FAST_DECODE_MODEL_TYPES
from portrl.workers.setup import AUTO_CHECKPOINTING_PARAMS
from portrl.workers.tape_budget import TAPE_PARAM_MULTIPLE

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

GIB = 2**30


def on_host(cfg: PortRLConfig) -> bool:
    """Whether the config runs on the CPU, as far as the config alone says (``device.name`` cpu, or auto)."""
    return str(cfg.device.name) in ("cpu", "auto")


def run_dtype(cfg: PortRLConfig, host: bool) -> str:
    """``device.dtype`` > ``model.dtype`` > float32 on the CPU, bfloat16 on an accelerator (the presets' choice;
    a run with its backend at hand passes the backend's own answer, portrl.workers.setup.resolve_dtype)."""
    return str(cfg.device.dtype or cfg.model.dtype or ("float32" if host else "bfloat16"))


def checkpointing_on(cfg: PortRLConfig, shape: ModelShape) -> bool:
    """``model.gradient_checkpointing``, or (null) on for models of at least AUTO_CHECKPOINTING_PARAMS."""
    flag = cfg.model.gradient_checkpointing
    return bool(flag) if flag is not None else shape.params >= AUTO_CHECKPOINTING_PARAMS


def mesh_of(cfg: PortRLConfig, world: int) -> MeshShape:
    a = cfg.actor
    return MeshShape.of(world, int(a.tensor_parallel_size), int(a.sequence_parallel_size), int(a.fsdp_size))


def workload_of_config(cfg: PortRLConfig, mesh: MeshShape) -> Workload:
    """The worst step of the config on one device: its data-parallel share of the prompts, every sequence at the
    longest lengths, micro-batches of ``actor.max_tokens_per_micro_batch`` tokens (else
    ``actor.ppo_micro_batch_size_per_device`` rows)."""
    d = cfg.data
    prompts = max(1, -(-int(d.train_batch_size) // mesh.dp))
    n, p_len, r_len = int(cfg.rollout.n), int(d.max_prompt_length), int(d.max_response_length)
    return _micro(Workload(prompts, n, p_len, r_len, 0, 0), cfg)


def workload_of_batch(cfg: PortRLConfig, mesh: MeshShape, prompts: int, prompt_len: int,
                      response_len: int, compacts: bool = True) -> Workload:
    """A running step's sizes on one device: its batch's prompts (all devices), longest prompt and response;
    ``compacts``: whether the engine dropped finished rows from its cache (:func:`compacted`)."""
    n = int(cfg.rollout.n)
    w = Workload(max(1, -(-prompts // mesh.dp)), n, prompt_len, response_len, 0, 0, compacts=compacts)
    return _micro(w, cfg)


def compacted(response_lengths: list[int], max_new_tokens: int) -> bool:
    """Whether the hf engine dropped finished rows mid-generation: once at least COMPACT_FRACTION of the rows (and
    one) finished before the last step (portrl.rollout.decode_rows.DecodeRows.compact)."""
    early = sum(1 for n in response_lengths if n < max_new_tokens)
    return early >= max(1, COMPACT_FRACTION * len(response_lengths))


def _micro_tokens(w: Workload, cfg: PortRLConfig, rows: int) -> tuple[int, int]:
    """(tokens, response tokens) of a micro-batch of at most ``rows`` rows: a shared prompt once and each of its
    rows' responses, up to ``actor.max_tokens_per_micro_batch`` (portrl.workers.training.split_micro_batches)."""
    budget = cfg.actor.max_tokens_per_micro_batch
    shared = bool(cfg.model.share_prompts) and bool(cfg.model.use_packing)
    group = (w.prompt_len if shared else w.n * w.prompt_len) + w.n * w.response_len  # one prompt's rows
    rows = min(rows, w.rows)
    tokens = -(-rows // w.n) * group if shared else rows * (w.prompt_len + w.response_len)
    if budget:
        tokens = min(tokens, max(int(budget), group))
    return tokens, tokens * w.n * w.response_len // group


def _micro(w: Workload, cfg: PortRLConfig) -> Workload:
    """``w`` with its update's micro-batch (``actor.ppo_micro_batch_size_per_device`` rows) and its no-grad
    passes' (4 x those rows: portrl.workers.training.inference_micro_batches)."""
    rows = int(cfg.actor.ppo_micro_batch_size_per_device)
    tokens, response = _micro_tokens(w, cfg, rows)
    inf_tokens, inf_response = _micro_tokens(w, cfg, 4 * rows)
    return replace(w, micro_tokens=tokens, response_tokens_micro=response, inference_tokens=inf_tokens,
                   response_tokens_inference=inf_response)


def records_forward(cfg: PortRLConfig, shape: ModelShape, engine: str, checkpointing: bool, w: Workload,
                    dtype_bytes: int, worst: bool = False) -> bool:
    """Whether the hf engine records the rollout's forward for the update (portrl.workers.actor: colocated, one
    generate call per step, a fast-decode family, packed with shared prompts; under checkpointing only within
    TAPE_PARAM_MULTIPLE x the weights' bytes, the first bound of portrl.workers.tape_budget). ``worst``: the
    config's worst step, where a shorter step than ``w`` may record up to that bound (:func:`tape_cap`)."""
    m = cfg.model
    if int(cfg.actor.lora_rank) > 0:  # the fast decode path, which records, does not take a PEFT model
        return False
    if not (engine == "hf" and str(cfg.rollout.placement) == "colocated" and bool(m.reuse_rollout_forward)
            and bool(m.use_packing) and bool(m.share_prompts) and not bool(cfg.rollout.multi_turn.enable)
            and shape.model_type in FAST_DECODE_MODEL_TYPES and str(cfg.trainer.mode) == "sync"):
        return False
    if not checkpointing or worst:
        return True
    return tape_bytes(shape, w, dtype_bytes) <= tape_cap(shape, dtype_bytes)


def tape_cap(shape: ModelShape, dtype_bytes: int) -> int:
    """The most a recording may hold under gradient checkpointing: TAPE_PARAM_MULTIPLE x the weights' bytes."""
    return TAPE_PARAM_MULTIPLE * shape.params * dtype_bytes


def engine_of(cfg: PortRLConfig, host: bool) -> str:
    """hf (portrl's own engine: memory as it goes) or reserving (an engine that takes
    ``rollout.gpu_memory_utilization`` of the device up front)."""
    engine = str(cfg.rollout.engine)
    if engine == "auto":
        return "hf" if host else "reserving"
    return "hf" if engine == "hf" else "reserving"


def offloaded(cfg: PortRLConfig, host: bool) -> frozenset[str]:
    """The parts the config keeps in host memory (portrl.plan.memory.Layout.offload); none on the CPU, where the
    host is the device and offload lowers nothing."""
    if host:
        return frozenset()
    a, c = cfg.actor.offload, cfg.critic.offload
    parts = {"params": a.params, "optimizer": a.optimizer, "activations": a.activations,
             "reference": cfg.ref.param_offload, "critic_params": c.params, "critic_optimizer": c.optimizer,
             "critic_activations": c.activations}
    return frozenset(name for name, on in parts.items() if on)


def layout_of_config(cfg: PortRLConfig, shape: ModelShape, mesh: MeshShape, w: Workload,
                     device_memory: Optional[int], dtype: str, host: bool, worst: bool = False) -> Layout:
    fsdp = str(cfg.actor.strategy) in ("auto", "fsdp") and mesh.fsdp > 1
    engine = engine_of(cfg, host)
    ckpt = checkpointing_on(cfg, shape)
    lora = int(cfg.actor.lora_rank) > 0
    return Layout(dtype_bytes=DTYPE_BYTES[dtype], shards=(mesh.fsdp if fsdp else 1) * mesh.tp,
                  tensor_parallel=mesh.tp, sequence_parallel=mesh.sp, fsdp=fsdp, checkpointing=ckpt,
                  reference=reference_enabled(cfg), critic=critic_enabled(cfg),
                  tape=records_forward(cfg, shape, engine, ckpt, w, DTYPE_BYTES[dtype], worst), engine=engine,
                  fast_decode=shape.model_type in FAST_DECODE_MODEL_TYPES and not lora,
                  tape_cap=tape_cap(shape, DTYPE_BYTES[dtype]) if ckpt else None,
                  engine_reserve=int(float(cfg.rollout.gpu_memory_utilization) * (device_memory or 0)),
                  logprob_chunk=int(cfg.model.logprob_chunk_size) if cfg.model.logprob_chunk_size else None,
                  trainable=lora_params(shape, int(cfg.actor.lora_rank), list(cfg.actor.lora_target_modules))
                  if lora else None, offload=offloaded(cfg, host))


@dataclass
class RunPlan:
    """Each phase's predicted peak per device against the device's memory (None: unknown)."""

    phases: list[PhasePeak]
    device_memory: Optional[int]

    @property
    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory is None else self.peak.bytes <= self.device_memory

    def as_dict(self) -> dict:
        return {"device_memory_gib": None if self.device_memory is None else self.device_memory / GIB,
                "fits": self.fits, "peak_phase": self.peak.phase,
                "phases": {p.phase: {"gib": p.bytes / GIB, "terms_gib": {k: v / GIB for k, v in p.terms.items()}}
                           for p in self.phases}}


@dataclass(frozen=True)
class Device:
    """What a plan knows of the device beyond the config: the training dtype and whether it is the host (a run
    passes its backend's answers; None: read from the config, :func:`run_dtype` and :func:`on_host`)."""

    dtype: Optional[str] = None
    host: Optional[bool] = None


def plan_run(cfg: PortRLConfig, shape: ModelShape, world: int, device_memory: Optional[int],
             workload: Optional[Workload] = None, device: Device = Device()) -> RunPlan:
    """The plan of ``cfg`` on ``world`` devices of ``device_memory`` bytes each (``workload``: a running step's
    sizes instead of the config's worst step)."""
    mesh = mesh_of(cfg, world)
    w = workload or workload_of_config(cfg, mesh)
    host = on_host(cfg) if device.host is None else device.host
    layout = layout_of_config(cfg, shape, mesh, w, device_memory, device.dtype or run_dtype(cfg, host), host,
                              worst=workload is None)
    return RunPlan(plan_phases(shape, w, layout), device_memory)
