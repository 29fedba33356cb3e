"""``portrl rehearse``: a cluster run's exact meshes and placement rehearsed on one machine, as CPU processes over
gloo, before cluster time is spent.

From the cluster run's config (its device preset and overrides, composed as ``portrl train`` would), the
rehearsal keeps what decides the process layout: ``trainer.num_workers`` (the cluster's ranks, e.g. 16 for
2 nodes x 8 devices: it must be set), every trained model's ``tensor_parallel_size``, ``sequence_parallel_size``,
``fsdp_size``, the algorithm (which models exist: critic, reference, PRIME's PRM), ``rollout.placement`` and
``rollout.n``, the packing and gradient checkpointing settings. It swaps what the machine cannot hold:

* the model for one of the same family (``model_type``) and the same attention heads, key/value heads and tied
  head, shrunk in depth (2 layers) and width (head dimension 8; an MLP width and vocabulary that every tensor
  parallel size divides), built from the model folder's ``config.json`` alone (no weights needed), with the
  built-in arith tokenizer (:func:`shrunk_model`);
* the device for the CPU (gloo, float32, the backend's own attention, the CPU's own peaks and memory: not the
  preset's ``device.model`` and ``device.memory_gib``), the rollout engine for ``hf`` (an engine's own tensor
  parallel rollout is not rehearsed), the data for the generated arith task, the batch for the smallest one every
  data-parallel size divides.

Then one RL step runs through the trainer: validation, rollout, reward, reference, critic / PRM, the update of
every trained model under its mesh, a checkpoint and the Hugging Face export. The first error (a configuration
error, a collective that hangs or fails, a shape that does not split) is reported in one line. What it cannot
show: device memory, the interconnect's speed, the accelerator's kernels (docs/scaling.md has the memory
arithmetic).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from portrl.config.checks_mesh import mesh_roles, mesh_sizes
from portrl.config.composition import copy_config
from portrl.device import get_backend
from portrl.device.mesh_shape import MeshShape
from portrl.errors import UserError
from portrl.models.tokenizer import build_tokenizer
from portrl.trainer.mesh_check import model_dims
from portrl.trainer.resources import TINY_VOCAB
from portrl.trainer.rl_trainer import run_training
from portrl.workers.ray_env import init_ray

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: the shrunk model's depth and head dimension
LAYERS, HEAD_DIM = 2, 8
#: the families the rehearsal can shrink (text decoders; tensor_parallel.py has plans for them)
SHRINKS = ("qwen2", "llama")


def cluster_world(cfg: PortRLConfig) -> int:
    """The cluster run's ranks: ``trainer.num_workers`` (UserError when it is left to detection: this machine's
    devices are not the cluster's)."""
    if cfg.trainer.num_workers is None:
        raise UserError("portrl rehearse needs the cluster's trainer.num_workers (its devices in all, e.g. 16 for "
                        "trainer.nnodes=2 x 8 devices): detection here would count this machine's, not the cluster's")
    return int(cfg.trainer.num_workers)


def shrunk_model(cfg: PortRLConfig, out_dir: Path) -> Path:
    """Write the rehearsal's model (module docstring) of ``model.path`` (or the built-in tiny model's sizes) to
    ``out_dir``; UserError for a family it cannot shrink."""
    dims = model_dims(cfg, str(cfg.model.path) if cfg.model.path else None)
    family = dims["model_type"]
    if family not in SHRINKS:
        raise UserError(f"portrl rehearse shrinks model_type {', '.join(SHRINKS)}; model.path is {family!r}")
    tps = [mesh_sizes(cfg, role)[0] for role in mesh_roles(cfg)]
    step = math.lcm(16, *tps)
    tokenizer = build_tokenizer(TINY_VOCAB)
    heads, kv = int(dims["num_heads"]), int(dims["num_kv_heads"])
    tied = True
    if cfg.model.path:
        tied = bool(json.loads((Path(str(cfg.model.path)).expanduser() / "config.json").read_text())
                    .get("tie_word_embeddings", False))
    config = AutoConfig.for_model(family, vocab_size=-(-len(tokenizer) // step) * step, hidden_size=heads * HEAD_DIM,
                                  intermediate_size=2 * step, num_hidden_layers=LAYERS, num_attention_heads=heads,
                                  num_key_value_heads=kv, head_dim=HEAD_DIM, tie_word_embeddings=tied,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=None, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _batch(cfg: PortRLConfig, world: int) -> int:
    """The smallest batch (prompts) every trained model's data-parallel size divides."""
    sizes = [MeshShape.of(world, *mesh_sizes(cfg, role)).dp for role in mesh_roles(cfg)]
    return math.lcm(*sizes)


def rehearsal_config(cfg: PortRLConfig, model_dir: Path, out_dir: Path) -> PortRLConfig:
    """``cfg`` (the cluster run's, composed) with the swaps of the module docstring; a new config."""
    world = cluster_world(cfg)
    batch = _batch(cfg, world)
    swaps: dict[str, Any] = {
        "device.name": "cpu", "device.dtype": "float32", "device.attn_impl": None, "model.attn_impl": None,
        "device.kernels": {}, "device.num_threads": 1, "device.model": None, "device.memory_gib": None,
        "trainer.use_ray": True, "trainer.ray_address": None,
        "model.path": str(model_dir), "model.tokenizer_path": None, "model.sft_warm_start": False,
        "rollout.engine": "hf", "rollout.n": min(int(cfg.rollout.n), 2), "data.name": "arith",
        "data.train_files": [], "data.val_files": [], "data.max_response_length": 8,
        "data.train_batch_size": batch, "actor.ppo_mini_batch_size": batch, "actor.ppo_micro_batch_size_per_device": 2,
        "actor.max_tokens_per_micro_batch": None, "trainer.total_steps": 1, "trainer.test_freq": 1,
        "trainer.save_freq": 1, "trainer.val_before_train": True, "trainer.export_hf": True,
        "trainer.output_dir": str(out_dir), "trainer.loggers": ["jsonl"], "trainer.plot": False,
        "critic.model_path": None, "reward_model.model.path": None, "reward_model.model.ref_path": None,
    }
    out = copy_config(cfg)
    for key, value in swaps.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def run_rehearsal(cfg: PortRLConfig, work_dir: Optional[str] = None) -> dict[str, Any]:
    """Rehearse ``cfg`` (module docstring): ``{"world", "meshes", "steps"}`` when every phase ran; the trainer's
    error (one line by ``portrl.cli``) at the first that did not."""
    world = cluster_world(cfg)
    meshes = {role: MeshShape.of(world, *mesh_sizes(cfg, role)) for role in mesh_roles(cfg)}
    with tempfile.TemporaryDirectory(prefix="portrl-rehearse-", dir=work_dir) as tmp:
        model_dir = shrunk_model(cfg, Path(tmp) / "model")
        run_cfg = rehearsal_config(cfg, model_dir, Path(tmp) / "run")
        # a CPU for each rank of each worker group, whatever this machine has (the processes share its cores)
        cpus = world * len(meshes) + int(run_cfg.rollout.num_rollout_workers) + 1
        init_ray(run_cfg, get_backend("cpu"), num_cpus=cpus)
        summary = run_training(run_cfg)
    return {"world": world, "meshes": {k: v.sizes for k, v in meshes.items()}, "steps": summary.get("steps")}
