"""Checks of the trained models' device meshes (portrl/device/mesh_shape.py) that the config alone decides.

* ``actor``, ``critic`` and ``reward_model.model`` (PRIME's PRM): ``tensor_parallel_size`` and
  ``sequence_parallel_size`` >= 1, ``fsdp_size`` -1 or >= 1;
* each model that runs (:func:`mesh_roles`) with an explicit ``trainer.num_workers``: its sizes form a mesh of that
  many ranks (:meth:`MeshShape.of`: tensor x sequence parallel divides the workers, the shard group divides the rest
  and holds whole sequence-parallel groups); null (auto) is checked by the preflight once resolved;
* sequence parallelism splits packed sequences: it needs ``model.use_packing=true``;
* a mesh (any tensor or sequence parallel size > 1) shards with FSDP2: ``actor.strategy`` (every trained model's)
  ``auto`` or ``fsdp``, not ``ddp`` (portrl.workers.parallel.wrap_model);
* LoRA (``actor.lora_rank > 0``) under ``actor.tensor_parallel_size > 1`` only on the decoder's linear layers:
  their adapters split with them (portrl.models.tensor_parallel), but the embedding and the LM head are split by
  vocabulary, which adapters on them cannot follow (``embed_tokens`` / ``lm_head`` in
  ``actor.lora_target_modules`` is refused).

What needs the model (its heads, key/value heads, MLP width, vocabulary, family) or the backend (its attention) is
the preflight's (portrl/trainer/mesh_check.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Protocol

from portrl.algo import critic_enabled, implicit_prm_enabled
from portrl.config.checks_algorithm import known_algorithm
from portrl.device.mesh_shape import MeshError, MeshShape

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: the config sections that hold a trained model's mesh sizes (the reference model follows the actor's)
MESH_SECTIONS = ("actor", "critic", "reward_model.model")
#: ``model_type`` (config.json) -> the family, for the models tensor parallelism has plans for (the preflight refuses
#: tensor_parallel_size > 1 for any other: portrl/trainer/mesh_check.py)
TP_MODEL_TYPES = {"qwen2": "Qwen2 / Qwen2.5", "llama": "Llama", "qwen2_5_vl": "Qwen2.5-VL's language model"}


class _MeshSizes(Protocol):
    """A section with mesh sizes (ActorConfig, CriticConfig, ImplicitPRMModelConfig)."""

    tensor_parallel_size: int
    sequence_parallel_size: int
    fsdp_size: int


def mesh_roles(cfg: PortRLConfig) -> List[str]:
    """The sections of the trained models this run builds: the actor; the critic and PRIME's PRM when enabled."""
    roles = ["actor"]
    if known_algorithm(cfg):  # an unknown estimator is reported by the registry check
        roles += ["critic"] if critic_enabled(cfg) else []
        roles += ["reward_model.model"] if implicit_prm_enabled(cfg) else []
    return roles


def mesh_sizes(cfg: PortRLConfig, role: str) -> tuple[int, int, int]:
    """``(tensor_parallel_size, sequence_parallel_size, fsdp_size)`` of section ``role``."""
    if role not in MESH_SECTIONS:
        raise ValueError(f"no mesh sizes in section {role!r}; valid: {', '.join(MESH_SECTIONS)}")
    node: Any = cfg  # only this section is read: a worker's config holds its own sections alone
    for part in role.split("."):
        node = getattr(node, part)
    s: _MeshSizes = node
    return int(s.tensor_parallel_size), int(s.sequence_parallel_size), int(s.fsdp_size)


def mesh_replicas(cfg: PortRLConfig, role: str) -> int:
    """Ranks of section ``role``'s model that hold the same rows: ``tensor_parallel_size x sequence_parallel_size``
    (its worker group gives them one piece of the batch: portrl.workers.group)."""
    tp, sp, _ = mesh_sizes(cfg, role)
    return tp * sp


def check_mesh(cfg: PortRLConfig) -> List[str]:
    """Every problem of the mesh sizes, one line each."""
    problems: List[str] = []
    for role in MESH_SECTIONS:
        tp, sp, fsdp = mesh_sizes(cfg, role)
        if tp < 1:
            problems.append(f"{role}.tensor_parallel_size={tp} must be >= 1 (1: no tensor parallelism)")
        if sp < 1:
            problems.append(f"{role}.sequence_parallel_size={sp} must be >= 1 (1: no sequence parallelism)")
        if fsdp < 1 and fsdp != -1:
            problems.append(f"{role}.fsdp_size={fsdp} must be -1 (shard over all data x sequence ranks) or >= 1")
    if problems:
        return problems
    workers = cfg.trainer.num_workers
    for role in mesh_roles(cfg):
        tp, sp, fsdp = mesh_sizes(cfg, role)
        if workers is not None and workers >= 1:  # < 1 is the range check's
            try:
                MeshShape.of(int(workers), tp, sp, fsdp, role=role)
            except MeshError as exc:
                problems.append(str(exc))
        if sp > 1 and not cfg.model.use_packing:
            problems.append(f"{role}.sequence_parallel_size={sp} splits packed sequences over its ranks, which needs "
                            f"model.use_packing=true (got false); set it, or {role}.sequence_parallel_size=1")
    return problems + _strategy_and_lora(cfg)


def _strategy_and_lora(cfg: PortRLConfig) -> List[str]:
    """A mesh needs FSDP2 (``actor.strategy`` auto or fsdp); LoRA adapters on the embedding or the head cannot
    follow their vocabulary split."""
    problems: List[str] = []
    meshes = [(role, *mesh_sizes(cfg, role)[:2]) for role in mesh_roles(cfg)]
    meshes = [(role, tp, sp) for role, tp, sp in meshes if tp * sp > 1]
    strategy = str(cfg.actor.strategy)
    if meshes and strategy not in ("auto", "fsdp"):
        role, tp, sp = meshes[0]
        problems.append(f"actor.strategy={strategy} cannot run the {role}'s mesh ({role}.tensor_parallel_size={tp}, "
                        f"{role}.sequence_parallel_size={sp}), which shards the model with FSDP2: set actor.strategy="
                        f"auto or fsdp, or both sizes 1")
    lora, tp = int(cfg.actor.lora_rank), int(cfg.actor.tensor_parallel_size)
    vocab_split = [t for t in cfg.actor.lora_target_modules if t in ("embed_tokens", "lm_head")]
    if lora > 0 and tp > 1 and vocab_split:
        problems.append(f"actor.lora_target_modules {vocab_split} with actor.tensor_parallel_size={tp}: tensor "
                        f"parallelism splits the embedding and the LM head by vocabulary, which LoRA adapters on them "
                        f"cannot follow; adapt the decoder's linear layers (q_proj, k_proj, v_proj, o_proj, "
                        f"gate_proj, up_proj, down_proj, or [all-linear]), or actor.tensor_parallel_size=1")
    return problems
