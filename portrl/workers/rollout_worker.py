"""RolloutWorker: a rollout engine with a model of its own, for ``rollout.placement=separated``.

Separated placement: the actor workers train (no engine), ``rollout.num_rollout_workers`` RolloutWorkers in a
resource pool of their own generate. After every actor update (and after a resume or SFT warm start) the
policy reaches them through :class:`~portrl.workers.weight_sync.WeightSyncLink`: trainer rank 0 sends full
tensors (LoRA deltas merged, base names) over the transport the backend chooses (``rollout.weight_transport``:
a broadcast over the backend's collective, or shared memory on one CPU node) in the mode
``rollout.weight_sync_mode`` (``full``, ``bucketed`` in buckets of ``rollout.weight_sync_bucket_mb`` MiB, or
``delta``; portrl/device/weight_transport.py), and each RolloutWorker loads them into its engine with
``update_weights``.

:func:`generate_batch` (engine + tokenizer -> rollout Batch) is shared with the colocated
:class:`~portrl.workers.actor.ActorRolloutWorker`. :func:`separated_rollout` builds the separated placement's
rollout side; importing this module provides it to that record (portrl/config/placement.py).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from portrl.agent.rollout import AgentRollout, agent_rollout, trajectory_meta
from portrl.config.placement import SEPARATED, provide_rollout_side
from portrl.device.backend import Backend
from portrl.device.split import ROLLOUT
from portrl.errors import UserError
from portrl.rollout import RolloutSettings, SamplingParams, make_engine
from portrl.models import load_tokenizer
from portrl.workers.batch import Batch, build_rollout_batch
from portrl.workers.group import WorkerGroup
from portrl.workers.partial_rollout import StagedWeights, generate_versioned, versions_tensor
from portrl.workers.profiled import ProfiledWorker
from portrl.workers.setup import count_parameters, resolve_dtype, start_worker
from portrl.workers.weight_sync import WeightSyncLink

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


@torch.no_grad()
def generate_batch(engine: Any, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], sampling: Mapping[str, Any],
                   meta: Optional[Mapping[str, Sequence[Any]]] = None, sleep_after: bool = False,
                   staged: Optional[StagedWeights] = None, partial: bool = False, min_version: int = 0,
                   agent: Optional[AgentRollout] = None) -> Batch:
    """Sample ``sampling["n"]`` responses per prompt with ``engine`` (the tokenizer's EOS added to the stop ids)
    -> a rollout Batch (rows prompt-major; ``meta`` lists, one entry per prompt, repeated for each sample;
    ``meta["finish_reason"]``; ``info["pad_token_id"]`` so a group can merge ranks' batches of other widths).
    ``sleep_after``: put the engine to sleep after generating, where it declares the ``sleep_wake`` capability.
    ``meta["multi_modal"]`` (image prompts, portrl/data/rl_dataset.py) goes to the engine as ``multi_modal=``
    when some prompt has images; the rollout rows then carry their prompt's entry like every meta list.
    ``staged`` (a separated rollout worker's :class:`~portrl.workers.partial_rollout.StagedWeights`): wait for
    ``min_version``, load the newest staged weights first, with ``partial`` continue rows that new weights stopped,
    and tag every token with its policy version (``rollout_versions``; portrl/workers/partial_rollout.py).
    ``agent`` (``rollout.multi_turn.enable``): every row runs its agent loop (portrl/agent/rollout.py) instead of one
    ``generate``; the Batch's ``response_mask`` is 0 on tool tokens and its meta carries the trajectories' turns,
    tool calls and traces. New weights reach a multi-turn rollout between requests only (no partial rollout)."""
    params = SamplingParams(**dict(sampling))
    stop = tuple(params.stop_token_ids)
    eos = tokenizer.eos_token_id
    if eos is not None and eos not in stop:
        params = SamplingParams(**{**dict(sampling), "stop_token_ids": stop + (int(eos),)})
    sleeps = engine.capabilities.sleep_wake
    if sleeps:
        engine.wake()
    images = (meta or {}).get("multi_modal")
    if images is not None and any(entry is not None for entry in images):  # image prompts: the engine takes them
        if "multi_modal" not in inspect.signature(engine.generate).parameters:
            raise UserError(f"the {engine.name or type(engine).__name__} rollout engine cannot generate from images; "
                            "use rollout.engine=hf (or an engine that takes multi_modal prompts)")
    else:
        images = None
    versions, masks, agent_meta = None, None, None
    if agent is not None:
        if images is not None:
            raise UserError("multi-turn rollouts (rollout.multi_turn.enable) of image prompts are not supported yet; "
                            "use text prompts or set rollout.multi_turn.enable=false")
        version = 0
        if staged is not None:
            staged.wait_for(min_version)
            version = staged.apply(engine.update_weights)
        trajs = agent.generate(engine, prompt_ids, params, meta)
        ids, lps = [t.response_ids for t in trajs], [t.logprobs for t in trajs]
        reasons, masks = [t.finish_reason for t in trajs], [t.response_mask for t in trajs]
        agent_meta = trajectory_meta(trajs)
        if staged is not None:
            versions = [[version] * len(r) for r in ids]
    elif staged is not None:
        ids, lps, reasons, versions = generate_versioned(engine, staged, prompt_ids, params, images, partial, min_version)
    else:
        out = (engine.generate([list(p) for p in prompt_ids], params, multi_modal=list(images)) if images is not None
               else engine.generate([list(p) for p in prompt_ids], params))
        ids, lps, reasons = out.response_ids, out.logprobs, out.finish_reasons
    if sleep_after and sleeps:
        engine.sleep()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = build_rollout_batch(prompt_ids, ids, lps, pad_token_id=pad, n=params.n, meta=meta, response_masks=masks)
    batch.meta["finish_reason"] = list(reasons)
    for key, column in (agent_meta or {}).items():
        batch.meta[key] = column
    batch.info["pad_token_id"] = pad
    if versions is not None:
        batch["rollout_versions"] = versions_tensor(versions, batch.tensors["responses"].shape[1])
    return batch


def rollout_settings(rollout: Any, data: Any, seed: int, dtype: str) -> RolloutSettings:
    """The engine-neutral :class:`~portrl.rollout.settings.RolloutSettings` of a run, from its ``rollout`` and
    ``data`` config sections, ``trainer.seed`` and the compute dtype. Each engine translates it into its own
    constructor options; the backend adjusts those (:func:`portrl.rollout.make_engine`)."""
    max_batched = rollout.max_num_batched_tokens
    return RolloutSettings(
        dtype=str(dtype), seed=int(seed), memory_fraction=float(rollout.gpu_memory_utilization),
        tensor_parallel=int(rollout.tensor_model_parallel_size), eager=bool(rollout.enforce_eager),
        max_sequence_length=int(data.max_prompt_length) + int(data.max_response_length),
        max_batched_tokens=None if max_batched is None else int(max_batched),
        sleep_between_rollouts=bool(rollout.enable_sleep_mode))


class RolloutWorker(ProfiledWorker):
    """Owns an engine loaded from ``model.path`` (its own copy of the policy) on its own device.
    ``model_path`` overrides ``cfg.model.path``."""

    config_sections = ("trainer", "device", "model", "data", "rollout", "async_training", "sandbox")  # reads (group.py)
    compute_side = ROLLOUT  # its cores in a separated run are the rollout side's (portrl.workers.placement)

    @staticmethod
    def devices_needed(cfg: Any) -> int:
        """Devices of one rollout worker: its engine's tensor-parallel size (the engine starts that many workers of
        its own, one per device the worker was given)."""
        return int(cfg.rollout.tensor_model_parallel_size)

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, model_path: Optional[str] = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.backend, self.device = start_worker(cfg, rank)
        path = model_path or cfg.model.path
        if not path:
            raise ValueError("RolloutWorker: model.path is empty; the trainer resolves the built-in tiny model first")
        self.model_path = str(path)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or self.model_path)
        settings = rollout_settings(cfg.rollout, cfg.data, int(cfg.trainer.seed), resolve_dtype(cfg, self.backend))
        self.engine = make_engine(str(cfg.rollout.engine), model_path=self.model_path, tokenizer=self.tokenizer,
                                  backend=self.backend, settings=settings,
                                  num_params=lambda: count_parameters(self.model_path))
        self.weights = StagedWeights()  # the engine's policy version and the newest one received (partial_rollout)
        self.partial = str(cfg.trainer.mode) == "async" and bool(cfg.async_training.partial_rollout)
        self.agent = agent_rollout(cfg, self.tokenizer)  # multi-turn rollouts (rollout.multi_turn.enable), else None

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Mapping[str, Any],
                 meta: Optional[Mapping[str, Sequence[Any]]] = None, min_version: int = 0) -> Batch:
        """See :func:`generate_batch`: tokens tagged with their policy version, after ``min_version`` arrived."""
        return generate_batch(self.engine, self.tokenizer, prompt_ids, sampling, meta,
                              sleep_after=bool(self.cfg.rollout.enable_sleep_mode), staged=self.weights,
                              partial=self.partial, min_version=min_version, agent=self.agent)

    def generate_from(self, prompts: Batch, sampling: Mapping[str, Any], min_version: int = 0) -> Batch:
        """:meth:`generate` for a prompt Batch (``meta["prompt_ids"]`` plus per-prompt meta), the form a group
        splits across ranks."""
        meta = {k: v for k, v in prompts.meta.items() if k != "prompt_ids"}
        return self.generate(prompts.meta["prompt_ids"], sampling, meta, min_version)

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load the policy's (name, full tensor) pairs into the engine (names as in the base checkpoint)."""
        self.engine.update_weights(named_tensors)

    def set_weights_version(self, version: int) -> None:
        """The policy version of the weights just loaded by :meth:`update_weights` (a synchronous pull)."""
        self.weights.version = int(version)

    def stage_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Keep a received policy version for the next generation (called by the listener thread,
        portrl.workers.ray_launcher.WorkerHost.start_weight_listener)."""
        self.weights.stage(int(version), list(named_tensors))

    def named_weights(self) -> Iterable[Tuple[str, torch.Tensor]]:
        """The engine model's (name, tensor) pairs, for checks (an engine without a torch model has none)."""
        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise NotImplementedError(f"the {self.engine.name} engine does not expose its weights")
        return model.state_dict().items()


def separated_rollout(cfg: PortRLConfig, backend: Backend, actor_group: Any) -> Tuple[Any, Any]:
    """``(rollout WorkerGroup, WeightSyncLink)`` for ``rollout.placement=separated``: ``rollout.num_rollout_workers``
    RolloutWorkers as Ray actors in a resource pool of their own, linked to ``actor_group`` (a Ray group)."""
    n = int(cfg.rollout.num_rollout_workers)
    if n < 1:
        raise ValueError(f"rollout.num_rollout_workers must be >= 1 with rollout.placement=separated, got {n}")
    group = WorkerGroup(RolloutWorker, cfg, n, backend, role="rollout")  # Ray (separated placement), a pool of its own
    link = WeightSyncLink(actor_group, group, float(cfg.rollout.weight_sync_bucket_mb),
                          str(cfg.rollout.weight_transport), str(cfg.rollout.weight_sync_mode))
    return group, link


provide_rollout_side(SEPARATED.name, separated_rollout)
