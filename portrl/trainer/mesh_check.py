"""The preflight's checks of the trained models' meshes: the run's workers, the models and the attention, checked
before any model loads (portrl/trainer/preflight.py).

For each trained model the run builds (:func:`portrl.config.checks_mesh.mesh_roles`; the reference model follows
the actor's mesh), in this order, a :class:`~portrl.errors.UserError` (one line) for the first problem:

* its sizes form a mesh of the run's workers (``trainer.num_workers``; null resolved as the run will,
  ``auto_num_workers``): :meth:`portrl.device.mesh_shape.MeshShape.of`;
* FSDP2 runs here (:func:`portrl.workers.parallel.fsdp_supported`): a mesh shards with it (``actor.strategy=auto``
  would otherwise fall back to DDP);
* tensor parallelism only for the families with tensor-parallel plans (:data:`TP_MODEL_TYPES`, by ``model_type``);
* sequence parallelism not for a vision-language model (``model_type`` in
  :data:`portrl.models.tiny_vl.VL_FAMILIES`): its forward (portrl/models/multimodal.py) is not sequence-parallel;
* the model's attention heads, key/value heads, MLP width and vocabulary split over it
  (:func:`portrl.device.mesh_shape.mesh_problems`), read from its folder's ``config.json`` (a vision-language
  model's ``text_config``) without loading it; the built-in tiny model's from ``model.tiny`` and its tokenizer;
* sequence parallelism only through portrl's varlen attention implementations: Ulysses exchanges heads inside
  them, and transformers' own (``hf_sdpa``, ``hf_eager``) cannot take it.

Then the rollout engine's own split, ``rollout.tensor_model_parallel_size``, of the policy's attention
(:func:`check_rollout_split`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from portrl.config.checks_mesh import TP_MODEL_TYPES, mesh_roles, mesh_sizes
from portrl.device.backend import Backend
from portrl.device.mesh_shape import MeshError, MeshShape, mesh_problems
from portrl.errors import UserError
from portrl.models.loader import HF_ATTENTION
from portrl.models.tiny_vl import VL_FAMILIES
from portrl.models.tokenizer import build_tokenizer
from portrl.trainer.resources import TINY_VOCAB
from portrl.workers.parallel import fsdp_supported
from portrl.workers.setup import auto_num_workers

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: config.json's names of the dimensions :func:`mesh_problems` takes
_DIMS = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size",
         "intermediate_size": "intermediate_size"}


def _model_of(cfg: PortRLConfig, role: str) -> tuple[str, Optional[str]]:
    """(how a message names the model of ``role``, its folder; None: the built-in tiny model)."""
    path = {"actor": cfg.model.path, "critic": cfg.critic.model_path,
            "reward_model.model": cfg.reward_model.model.path}[role]
    if path:
        key = {"actor": "model.path", "critic": "critic.model_path", "reward_model.model": "reward_model.model.path"}
        return f"{key[role]} {str(path)!r}", str(path)
    if cfg.model.path:  # the critic and the PRM start from the policy's weights
        return f"model.path {str(cfg.model.path)!r}", str(cfg.model.path)
    return "the built-in tiny model (model.path empty)", None


def model_dims(cfg: PortRLConfig, path: Optional[str]) -> dict[str, Any]:
    """``model_type`` and the dimensions :func:`mesh_problems` takes (None where config.json has none)."""
    if path is None:
        t = cfg.model.tiny
        vocab = -(-len(build_tokenizer(TINY_VOCAB)) // 16) * 16  # as portrl.models.tiny.write_tiny_model sizes it
        return {"model_type": "qwen2", "num_heads": int(t.num_heads), "num_kv_heads": int(t.num_kv_heads),
                "vocab_size": vocab, "intermediate_size": int(t.intermediate_size)}
    raw = json.loads((Path(path).expanduser() / "config.json").read_text())
    text = raw.get("text_config") or {}  # a vision-language model: its language model's dimensions
    dims = {name: text.get(key, raw.get(key)) for name, key in _DIMS.items()}
    dims["num_kv_heads"] = dims["num_kv_heads"] or dims["num_heads"]  # no key/value heads of its own: multi-head
    return {"model_type": raw.get("model_type"), **dims}


def _world(cfg: PortRLConfig, backend: Backend) -> tuple[int, str]:
    """The run's workers, and how a message says where the number came from."""
    if cfg.trainer.num_workers is not None:
        return int(cfg.trainer.num_workers), ""
    n, why = auto_num_workers(cfg, backend)
    return n, f" (trainer.num_workers=null is {n} here: {why})"


def check_meshes(cfg: PortRLConfig, backend: Backend) -> None:
    """UserError (one line) for the first mesh that does not fit the workers, its model or the attention."""
    world, auto = _world(cfg, backend)
    for role in mesh_roles(cfg):
        tp, sp, fsdp = mesh_sizes(cfg, role)
        try:
            shape = MeshShape.of(world, tp, sp, fsdp, role=role)
        except MeshError as exc:
            raise MeshError(str(exc) + auto) from None  # the message is MeshShape.of's
        if tp == 1 and sp == 1:
            continue
        _check_fsdp(backend, role, tp, sp)
        where, path = _model_of(cfg, role)
        dims = model_dims(cfg, path)
        family = dims.pop("model_type")
        if tp > 1 and family not in TP_MODEL_TYPES:
            raise UserError(f"{role}.tensor_parallel_size={tp}: tensor parallelism has plans for "
                            f"{', '.join(TP_MODEL_TYPES.values())} (model_type {', '.join(TP_MODEL_TYPES)}); {where} "
                            f"is model_type {family!r}: use {role}.tensor_parallel_size=1 (FSDP shards it)")
        if sp > 1 and family in VL_FAMILIES:
            tp_note = f" ({role}.tensor_parallel_size > 1 splits its language model)" if family in TP_MODEL_TYPES else ""
            raise UserError(f"{role}.sequence_parallel_size={sp}: {where} is model_type {family!r}, a vision-language "
                            f"model, whose forward (portrl/models/multimodal.py) is not sequence-parallel; use "
                            f"{role}.sequence_parallel_size=1{tp_note}")
        missing = [_DIMS[name] for name, value in dims.items() if value is None]
        if missing:
            raise UserError(f"{where}: its config.json has no {', '.join(missing)}, which {role}.tensor_parallel_size "
                            f"and {role}.sequence_parallel_size split; use sizes 1 for this model")
        problems = mesh_problems(shape, num_heads=int(dims["num_heads"]), num_kv_heads=int(dims["num_kv_heads"]),
                                 vocab_size=int(dims["vocab_size"]),
                                 intermediate_size=int(dims["intermediate_size"]), role=role)
        if problems:
            raise UserError(f"{where} does not split over the {role}'s mesh: {problems[0]}")
        _check_attention(cfg, backend, role, sp)
    check_rollout_split(cfg)


def rollout_tp_sizes(num_heads: int, num_kv_heads: int, up_to: int = 64) -> list[int]:
    """The rollout tensor-parallel sizes (at most ``up_to``) a model's attention splits over, as the engines that
    shard it require: the attention heads divide evenly, and the key/value heads too, or, where there are fewer
    of them than workers, each is copied to a whole number of workers (``tp % num_kv_heads == 0``)."""
    return [tp for tp in range(1, up_to + 1) if num_heads % tp == 0
            and (num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0)]


def check_rollout_split(cfg: PortRLConfig) -> None:
    """UserError (one line) when ``rollout.tensor_model_parallel_size`` does not split the policy's attention
    (:func:`rollout_tp_sizes`), read from its config.json before any engine starts. The ``hf`` engine keeps one
    whole model per rank and takes no size, so it is not checked for it."""
    tp = int(cfg.rollout.tensor_model_parallel_size)
    if tp == 1 or cfg.rollout.engine == "hf":
        return
    where, path = _model_of(cfg, "actor")
    dims = model_dims(cfg, path)
    if dims["num_heads"] is None:
        raise UserError(f"{where}: its config.json has no num_attention_heads, which rollout.tensor_model_parallel_size"
                        f"={tp} splits; use rollout.tensor_model_parallel_size=1 for this model")
    heads, kv = int(dims["num_heads"]), int(dims["num_kv_heads"])
    valid = rollout_tp_sizes(heads, kv)
    if tp not in valid:
        raise UserError(f"rollout.tensor_model_parallel_size={tp}: the rollout engine splits the attention over its "
                        f"workers and {where} has {heads} attention heads and {kv} key/value heads; valid sizes: "
                        f"{', '.join(map(str, valid))}")


def _check_fsdp(backend: Backend, role: str, tp: int, sp: int) -> None:
    """A mesh shards with FSDP2, which must run here (with ``actor.strategy=auto`` it would fall back to ddp; an
    explicit ``ddp`` is the config's check)."""
    ok, why = fsdp_supported(backend)
    if not ok:
        raise UserError(f"{role}.tensor_parallel_size={tp}, {role}.sequence_parallel_size={sp}: the mesh shards the "
                        f"model with FSDP2, which cannot run here ({why}); use both sizes 1 on this machine")


def _check_attention(cfg: PortRLConfig, backend: Backend, role: str, sp: int) -> None:
    """Sequence parallelism needs one of portrl's varlen attention implementations (not transformers' own)."""
    key = "device.attn_impl" if cfg.device.attn_impl else "model.attn_impl"
    attn = cfg.device.attn_impl or cfg.model.attn_impl
    if sp > 1 and attn in HF_ATTENTION:
        offered = ", ".join(backend.kernel_preferences().get("attention_varlen", ())) or "none"
        raise UserError(f"{role}.sequence_parallel_size={sp} exchanges attention heads inside portrl's varlen "
                        f"attention; {key}={attn} is transformers' own, which cannot take it: leave {key} null (the "
                        f"backend's choice) or one that backend {backend.name} offers: {offered}")
