"""Per-process set-up every worker (and the in-process trainer) does: backend, threads, env, determinism, dtype."""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from portrl.config.placement import placement_of
from portrl.device import resolve_backend
from portrl.device.backend import Backend
from portrl.models.loader import model_class
from portrl.ops import registry

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def worker_backend(cfg: PortRLConfig):
    """The Backend named by ``device.name`` (``auto`` = detection); errors name ``device.name_source``."""
    name = cfg.device.name
    return resolve_backend(config=None if name in (None, "auto") else str(name),
                           config_source=cfg.device.name_source)


def auto_num_workers(cfg: PortRLConfig, backend: Backend) -> tuple[int, str]:
    """What ``trainer.num_workers=null`` (auto) means on this node: ``(workers, why)``.

    Every device ``backend`` sees here (``device_count()``, which respects the vendor's visible-devices variable)
    times ``trainer.nnodes`` (nodes alike, as verl's ``n_gpus_per_node x nnodes``), less the devices of separated
    rollout workers (``rollout.num_rollout_workers``); at least 1. The CPU backend is one device: 1 worker.
    ``trainer.use_ray=false`` runs in this process: 1 worker.
    """
    t = cfg.trainer
    if backend.device_type == "cpu":
        return 1, f"the {backend.name} backend is one device"
    if t.use_ray is not None and not t.use_ray:
        return 1, "trainer.use_ray=false runs one worker in this process"
    count = int(backend.device_count())
    nodes = int(t.nnodes)
    why = f"{count} {backend.name} device(s) visible on this node" + (f" x trainer.nnodes={nodes}" if nodes > 1 else "")
    total = count * nodes
    placement = placement_of(cfg)
    taken, setting = placement.devices_taken(cfg)
    if taken:
        total -= taken
        why += f", less {setting} (rollout.placement={placement.name})"
    return max(1, total), why


def resolve_num_workers(cfg: PortRLConfig, backend: Backend) -> int:
    """``trainer.num_workers`` for a run on ``backend``: the value when set, else :func:`auto_num_workers` (logged).
    The caller records the result in its config (preflight, RLTrainer) so that everything after sees one number."""
    explicit = cfg.trainer.num_workers
    if explicit is not None:
        return int(explicit)
    n, why = auto_num_workers(cfg, backend)
    logging.getLogger(__name__).info("trainer.num_workers=null -> %d (%s)", n, why)
    return n


#: the cores :func:`pin_process` pinned this process to (None: not pinned, it runs on every core it may use)
_pinned: Optional[tuple[int, ...]] = None


def pin_process(cores: Sequence[int]) -> tuple[int, ...]:
    """Pin this process (every thread it has now, and so the threads they start) to ``cores`` and set torch's
    intra-op threads to their number. A Ray worker of a separated run calls it before its worker is built
    (portrl.workers.ray_launcher, whose driver logs what each worker reports); from then on
    :func:`setup_process` keeps that thread count (``device.num_threads`` applies to processes that are not
    pinned). Returns the cores the process runs on now (``os.sched_getaffinity(0)``, sorted)."""
    global _pinned
    want = {int(c) for c in cores}
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:  # 0: this thread
        try:
            os.sched_setaffinity(int(task), want)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    _pinned = tuple(sorted(os.sched_getaffinity(0)))
    torch.set_num_threads(len(_pinned))
    return _pinned


def setup_process(cfg: PortRLConfig, backend: Backend, rank: int = 0) -> None:
    """Apply the backend's env presets and ``device.env``, torch threads, the determinism flag and the op
    implementations of ``device.kernels`` (``portrl.ops.registry.choose``).

    Torch threads: ``device.num_threads`` when set, except in a process :func:`pin_process` pinned, which keeps one
    thread per core it was given.

    ``trainer.deterministic``: ``torch.use_deterministic_algorithms(True)`` plus the backend's
    deterministic env presets (set before the first kernel runs, as the libraries read them then).
    Env variables the user already set win over presets.
    """
    deterministic = bool(cfg.trainer.deterministic)
    backend.configure_allocator()
    for k, v in backend.env_presets(deterministic=deterministic).items():
        os.environ.setdefault(k, str(v))
    for k, v in dict(cfg.device.env or {}).items():
        os.environ[str(k)] = str(v)
    threads = len(_pinned) if _pinned else cfg.device.num_threads
    if threads:
        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
    registry.choose(dict(cfg.device.kernels or {}))
    hf_logging.disable_progress_bar()  # per-load "Loading weights" bars would drown the training console


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global random generators with ``seed`` (numpy's modulo 2**32)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_dtype(cfg: PortRLConfig, backend: Backend) -> str:
    """``device.dtype`` > ``model.dtype`` > the backend's preferred training dtype."""
    dtype = cfg.device.dtype or cfg.model.dtype or backend.supported_dtypes()[0]
    valid = tuple(backend.supported_dtypes())
    if dtype not in valid:
        raise ValueError(f"dtype {dtype!r} is not supported by backend {backend.name!r}; valid: {list(valid)}")
    if dtype == "bfloat16" and not backend.supports_bf16():
        logging.getLogger(__name__).warning(
            "device.dtype=bfloat16 on %s, which has no native bfloat16 arithmetic: it is emulated and several "
            "times slower than float32 (portrl doctor); float32 master weights keep the updates exact", backend.name)
    return str(dtype)


def local_device_index(backend: Backend, rank: int) -> int | None:
    """This worker's device index on its node: ``LOCAL_RANK`` (set by the Ray layer), else rank modulo the
    node's device count; None on the CPU."""
    if backend.device_type == "cpu":
        return None
    local = os.environ.get("LOCAL_RANK")
    return int(local) if local is not None else rank % max(1, backend.device_count())


def start_worker(cfg: PortRLConfig, rank: int = 0):
    """What every worker does first: resolve the backend, set up the process, pick its device.
    Returns ``(backend, device)``."""
    backend = worker_backend(cfg)
    setup_process(cfg, backend, rank)
    return backend, backend.device(local_device_index(backend, rank))


AUTO_CHECKPOINTING_PARAMS = 100_000_000


def count_parameters(model_dir: str) -> int:
    """Parameters of the causal LM in ``model_dir``, from its config.json alone (built on the meta device:
    no weights are read or allocated; tied weights count once)."""
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):  # model_class loads transformers' modeling stack only now (preflight imports this)
        model = model_class(config).from_config(config)  # a vision-language model counts its vision tower too
    return sum(p.numel() for p in model.parameters())


def use_gradient_checkpointing(cfg: PortRLConfig, model_dir: str) -> bool:
    """``model.gradient_checkpointing``; when null, on for models of at least AUTO_CHECKPOINTING_PARAMS (100M)
    parameters (Qwen2.5-0.5B and up), whose stored activations of a training forward cost gigabytes, and off below
    (the tiny model), where recomputing them would only cost time."""
    flag = cfg.model.gradient_checkpointing
    if flag is not None:
        return bool(flag)
    on = count_parameters(model_dir) >= AUTO_CHECKPOINTING_PARAMS
    logging.getLogger(__name__).info("model.gradient_checkpointing=null -> %s (%s)", on, model_dir)
    return on
