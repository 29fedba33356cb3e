"""Run identity: which run a checkpoint or an output directory belongs to.

A run is defined by the config keys below (``IDENTITY_KEYS``); their values are recorded in every
checkpoint's manifest (``meta.identity``, with ``meta.fingerprint``, a sha256 prefix of their JSON) and in
``<output_dir>/run.json``. ``trainer.resume=auto`` (and ``resume=PATH``) continues only a run whose
identity equals the current config's; any difference is a :class:`~portrl.trainer.checkpoint.CheckpointError`
listing ``key: old -> new``.

Identity keys (what the trained weights and the data order depend on):

* model: ``model.path`` (the built-in tiny model is recorded as ``<tiny>`` plus ``model.tiny``, not by its
  cache path), ``model.tokenizer_path``, ``actor.lora_rank`` (the layout of the trained state);
* data: ``data.name``, ``data.train_files`` (a generated task's cached files are recorded as none, as before they
  are resolved: portrl.trainer.resources), ``data.arith.{num_train, difficulty, seed}``, ``data.shuffle``,
  ``data.seed``, ``data.max_prompt_length``, ``data.max_response_length``, ``data.filter_overlong_prompts``,
  ``data.truncation``;
* algorithm: the whole ``algorithm`` section (estimator, KL, filtering, objective), ``actor.use_kl_loss``,
  ``actor.policy_loss.loss_mode``;
* seed: ``trainer.seed``;
* batch shape: ``data.train_batch_size``, ``rollout.n``, ``actor.ppo_mini_batch_size``.

Everything else may change when a run resumes, in particular ``trainer.total_steps`` (extend or shorten a
run), the learning-rate schedule (``actor.optim.*``, ``critic.optim.*``: a changed ``lr`` is applied to the
scheduler's base learning rate and logged), logging (``trainer.loggers``, ``progress_bar``, ``plot``,
``export_hf``), ``trainer.test_freq`` / ``save_freq`` / ``max_ckpt_to_keep``, validation data
(``data.val_files``, ``data.arith.num_test``, ``max_val_samples``, ``val_batch_size``, ``rollout.val_kwargs``),
the number of workers, the device and the mesh (``actor.strategy``, ``tensor_parallel_size``,
``sequence_parallel_size``, ``fsdp_size`` of the actor, the critic and the PRM: a checkpoint holds full tensors
keyed by parameter name, or shards of a 1-D FSDP2 mesh that any mesh reads by rank or joined whole, so it loads
bit for bit under any mesh and on one rank; portrl.parity.mesh_reshard),
loss coefficients tuned mid-run (``actor.clip_ratio*``, ``entropy_coeff``, ``kl_loss_coef``, ``ppo_epochs``) and
the warm-start keys (``model.sft_*``, ``critic.pretrain_*``: they act only on a fresh start).

``run.json`` (``RUN_FILE``) also carries a random ``run_id`` so that a trainer object that calls ``fit()`` again
recognises the run it started itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from omegaconf import OmegaConf

from portrl import __version__
from portrl.trainer.data_cache import generated_files
from portrl.trainer.resources import tiny_model_dir

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

RUN_FILE = "run.json"
TINY = "<tiny>"

#: dotted config keys; a key naming a section records the whole section
IDENTITY_KEYS = (
    "model.path", "model.tokenizer_path", "actor.lora_rank",
    "data.name", "data.train_files", "data.arith.num_train", "data.arith.difficulty", "data.arith.seed",
    "data.shuffle", "data.seed", "data.max_prompt_length", "data.max_response_length",
    "data.filter_overlong_prompts", "data.truncation",
    "algorithm", "actor.use_kl_loss", "actor.policy_loss.loss_mode",
    "trainer.seed",
    "data.train_batch_size", "rollout.n", "actor.ppo_mini_batch_size",
)


def _get(cfg: PortRLConfig, key: str) -> Any:
    node: Any = cfg  # a walk by dotted name (IDENTITY_KEYS)
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return _plain(node)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _flat(d: Any, prefix: str) -> Dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}"))
    return out


def _is_tiny_path(cfg: PortRLConfig, path: Optional[str]) -> bool:
    """True when ``path`` is the cached built-in tiny model for ``model.tiny`` (see portrl.trainer.resources)."""
    if not path:
        return True
    return Path(str(path)) == tiny_model_dir(cfg)


def run_identity(cfg: PortRLConfig) -> Dict[str, Any]:
    """The identity of the run ``cfg`` describes: ``{dotted key: value}`` (JSON values, sections flattened)."""
    ident: Dict[str, Any] = {}
    for key in IDENTITY_KEYS:
        ident.update(_flat(_get(cfg, key), key))
    if _is_tiny_path(cfg, ident.get("model.path")):
        ident["model.path"] = TINY
        ident.update(_flat(_get(cfg, "model.tiny"), "model.tiny"))
    else:
        ident["model.path"] = os.path.abspath(os.path.expanduser(str(ident["model.path"])))
    generated = generated_files(cfg)
    if generated is not None and ident.get("data.train_files") == [str(generated[0])]:
        ident["data.train_files"] = []  # resolved by settle_config; the identity is the one the preflight saw
    if ident.get("data.train_files"):
        ident["data.train_files"] = [os.path.abspath(os.path.expanduser(str(f))) for f in ident["data.train_files"]]
    return json.loads(json.dumps(ident, sort_keys=True, default=str))  # plain, comparable values


def fingerprint(identity: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity_diff(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """``["key: old -> new", ...]`` for every key whose value differs (a key only one side has included)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if a != b:
            out.append(f"{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return out


def read_run_record(out_dir: str | os.PathLike) -> Optional[Dict[str, Any]]:
    """``<out_dir>/run.json`` as a dict; None when absent; ``{}`` when unreadable (treated as an unknown run)."""
    path = Path(out_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except (ValueError, OSError, UnicodeDecodeError):
        return {}
    return rec if isinstance(rec, dict) and isinstance(rec.get("identity"), dict) else {}


def write_run_record(out_dir: str | os.PathLike, identity: Dict[str, Any]) -> Dict[str, Any]:
    """Write a new ``run.json`` (temp file + rename); returns the record (with its fresh ``run_id``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rec = {"run_id": uuid.uuid4().hex, "created": time.time(), "portrl_version": __version__,
           "fingerprint": fingerprint(identity), "identity": identity}
    tmp = out / f".{RUN_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
    os.replace(tmp, out / RUN_FILE)
    return rec


MODEL_KEYS = ("model.", "actor.lora_rank")

__all__ = ["MODEL_KEYS", "IDENTITY_KEYS", "RUN_FILE", "run_identity", "fingerprint", "identity_diff",
           "read_run_record", "write_run_record"]
