"""Data parallelism inside a worker: process-group setup, model wrapping, gradient clipping.

Strategies (``actor.strategy``):

* ``fsdp`` -- FSDP2 (``torch.distributed.fsdp.fully_shard``): every transformer block (the classes the
  model names in ``_no_split_modules``) is sharded, then the root. Parameters become DTensors.
* ``ddp``  -- ``DistributedDataParallel``: full replicas, gradients averaged by all-reduce.
* ``auto`` -- ``fsdp`` where it runs, ``ddp`` otherwise (:func:`fsdp_supported`). Measured with torch
  2.13 (tests/test_distributed_ray.py): FSDP2 runs on the CPU with gloo (all-gather and
  reduce-scatter of CPU tensors), and two ranks give the single-rank update to float32 tolerance.
* ``none`` -- the model as it is.

With one rank (no process group, or ``world_size == 1``) every strategy returns the model unchanged.
Both wrappers *average* gradients over ranks, so a loss normalised by global counts must be
multiplied by the data-parallel size (see ``portrl.workers.training.global_counts``).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import math
import os
import random
import socket
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from portrl.workers.mesh import ParallelMesh, grad_norm_groups, parallelize, shard_blocks

if TYPE_CHECKING:
    from portrl.device.backend import Backend

STRATEGIES = ("auto", "fsdp", "ddp", "none")
log = logging.getLogger(__name__)


#: the lowest port :func:`find_free_port` picks: above Ray's worker ports (10002-19999 by default)
LISTEN_PORTS_FROM = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The range the OS gives outgoing connections their local ports from (Linux's
    ``net.ipv4.ip_local_port_range``; 32768-60999, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(x) for x in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A TCP port free on ``host`` now, for a rendezvous that rank 0 will listen on a moment later: a random one
    from :data:`LISTEN_PORTS_FROM` up to the OS's ephemeral range, tested by binding it.

    Not the OS's pick (binding port 0): that comes from the ephemeral range, which every outgoing connection on the
    host also draws its local port from, so between this call and the listen a Ray process's connection could take
    it (CI: ``EADDRINUSE`` in ``init_process_group`` while two test processes ran Ray clusters). Below that range
    only listeners that choose their port take one. Falls back to the OS's pick when no port there is free (or the
    ephemeral range starts too low to leave one)."""
    low = LISTEN_PORTS_FROM
    high = min(_ephemeral_ports()[0], 65536)
    rng = random.SystemRandom()
    for _ in range(attempts if high - low > 100 else 0):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """``host`` is this machine's loopback address (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def init_distributed(backend: Backend, rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout_s: float = 600.0) -> None:
    """``torch.distributed.init_process_group`` with ``backend.dist_backend`` over TCP ``master_addr:master_port``.

    Also exports RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and LOCAL_RANK=0 unless already set: a Ray
    worker sees only its own devices) for libraries that read them. A no-op when a group already exists with the same size.

    On one machine (``master_addr`` a loopback address, as a local Ray gives) nothing listens beyond it: rank 0's
    TCP store serves on a socket bound to ``master_addr`` (torch's own would listen on every interface), and
    gloo's connections use the loopback interface (``GLOO_SOCKET_IFNAME=lo`` unless set, on Linux).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"a process group already exists (rank {dist.get_rank()} of {dist.get_world_size()}); "
                               f"cannot join as rank {rank} of {world_size}")
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                      MASTER_PORT=str(master_port))
    os.environ.setdefault("LOCAL_RANK", "0")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_loopback(master_addr):
        dist.init_process_group(backend.dist_backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = loopback_store(master_addr, master_port, rank == 0, world_size, timeout)
    dist.init_process_group(backend.dist_backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def loopback_store(host: str, port: int, is_master: bool, world_size: int, timeout: datetime.timedelta):
    """A ``torch.distributed.TCPStore`` whose server (on the master) listens on ``host`` only."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def dp_world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fsdp_supported(backend: Backend) -> tuple[bool, str]:
    """Whether FSDP2 can run with this backend here, and why not. Needs ``fully_shard`` in torch and a
    collective backend with all-gather-into-tensor and reduce-scatter-tensor (gloo has both in torch >= 2.6;
    the accelerator collectives always had them)."""
    try:  # here, not at the top: older torch has no fully_shard (that is the check), and it takes ~0.5 s to import
        from torch.distributed.fsdp import fully_shard  # noqa: F401,PLC0415  (FSDP: only in a sharded run)
    except ImportError as exc:
        return False, f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard ({exc})"
    if backend.dist_backend == "gloo":
        major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        if (major, minor) < (2, 6):
            return False, f"gloo reduce_scatter_tensor needs torch >= 2.6, found {torch.__version__}"
    return True, ""


def resolve_strategy(strategy: str, backend: Backend) -> str:
    """``auto`` -> ``fsdp`` or ``ddp`` (logged with the reason); an unknown name is an error listing the valid ones."""
    if strategy not in STRATEGIES:
        raise ValueError(f"actor.strategy {strategy!r} is unknown; valid: {list(STRATEGIES)}")
    if strategy != "auto":
        return strategy
    ok, why = fsdp_supported(backend)
    if not ok:
        log.info("strategy auto -> ddp (%s)", why)
    return "fsdp" if ok else "ddp"


class ForwardModule(nn.Module):
    """Runs ``fn(model, *args, **kwargs)`` as this module's forward.

    Data-parallel wrappers act in forward hooks: DDP prepares its gradient all-reduce, FSDP2 gathers the
    parameters a unit owns. A training forward that reaches into the model (calls the decoder, then uses the
    LM head's weight in a fused log-prob op, as ``portrl.models.compute_logprobs`` does) bypasses them; wrapping
    ``ForwardModule(model, compute_logprobs)`` and calling the wrapped result runs the whole computation
    inside one root forward, so both wrappers see it.
    """

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def _block_classes(model: nn.Module) -> set:
    names: set = set()
    for m in model.modules():  # HF models (also under peft / ForwardModule) name their blocks
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def wrap_model(model: nn.Module, strategy: str, backend: Backend, *, device: Optional[torch.device] = None,
               compute_dtype: Union[str, torch.dtype, None] = None, mesh: Optional[ParallelMesh] = None) -> nn.Module:
    """The model wrapped for data parallelism over the default process group (see the module docstring).

    ``device``: where the model lives (default ``backend.device()``); the model is moved there first.
    ``compute_dtype`` (FSDP2): a bfloat16 / float16 compute dtype for a float32 model gets
    ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``: the sharded float32
    parameters are the master weights, gathered in the compute dtype, gradients reduced in float32.
    FSDP2 shards in place and returns the same module object (now holding DTensors); DDP returns a wrapper
    whose ``.module`` is the model. A LoRA model (peft) is wrapped alike: its frozen base is sharded (and cast
    for compute) with the blocks that hold it; only the adapters get gradients.
    ``mesh``: a data x sequence x tensor parallel mesh (portrl.workers.mesh); the strategy must then be ``fsdp``.
    """
    strategy = resolve_strategy(strategy, backend)
    device = device if device is not None else backend.device()
    model = model.to(device)
    if mesh is not None and strategy != "fsdp":
        raise ValueError(f"a mesh with tensor or sequence parallelism needs actor.strategy=fsdp, not {strategy!r}")
    if dp_world_size() == 1 or strategy == "none":
        return model
    if strategy == "ddp":
        ids = None if device.type == "cpu" else [device]
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415  (FSDP: only in a sharded run)

    compute = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    policy = None
    if compute in (torch.bfloat16, torch.float16) and next(model.parameters()).dtype == torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    blocks = _block_classes(model)
    if mesh is not None:
        return parallelize(model, mesh, blocks, policy)
    return shard_blocks(model, blocks, init_device_mesh(device.type, (dp_world_size(),)), policy)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (FSDP2 and plain models are returned as they are)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def clip_grad_norm(parameters: Union[nn.Module, Iterable[torch.Tensor]], max_norm: float) -> float:
    """Clip gradients to total L2 norm ``max_norm`` and return the norm before clipping, as a float.

    Works for plain, DDP and FSDP2 (DTensor) gradients: with FSDP2 the norm of the local shards is reduced
    over the mesh (``full_tensor()``), so every rank gets the global norm. A non-finite norm leaves the
    gradients untouched; the caller must then skip ``optimizer.step()``. ``max_norm <= 0`` only measures.
    """
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = []
    for group in grad_norm_groups(grads):  # one group except under a tensor-parallel mesh
        total = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append(total.full_tensor() if hasattr(total, "full_tensor") else total)
    norm = float(norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms)))
    coef = max_norm / (norm + 1e-6)
    if max_norm > 0 and math.isfinite(norm) and coef < 1.0:
        for g in grads:  # a python float scales plain tensors and DTensor shards alike
            g.mul_(coef)
    return norm


def full_state_dict(model: nn.Module) -> dict:
    """Full (unsharded) tensors keyed by the unwrapped model's names, on the CPU. Every rank must call it
    under FSDP2 (each DTensor is all-gathered)."""
    out = {}
    for name, t in unwrap_model(model).state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().to("cpu")
    return out


def frozen_parameter_names(model: nn.Module) -> set:
    """Names of the parameters that do not train (``requires_grad`` off: a LoRA run's base model)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def require_trainable(model: nn.Module, model_state) -> None:
    """A ValueError when ``model_state`` does not fit ``model``: it lacks a trainable parameter or has a tensor the
    model does not (a state written for another model layout, say other LoRA targets). Frozen parameters may
    be absent."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in model_state]
    names = set(model.state_dict())  # under FSDP2 the local shards: nothing is gathered
    unknown = [n for n in model_state if n not in names]
    if missing or unknown:
        raise ValueError(f"the saved model state does not fit this model (missing {missing[:3]}, unknown "
                         f"{unknown[:3]}): it was written for another layout (actor.lora_rank / lora_target_modules)")


def full_train_state(model: nn.Module, optimizer, full: bool = True) -> tuple:
    """``(model state, optimizer state)`` with every sharded tensor gathered to a full one, keyed by parameter
    names (``torch.distributed.checkpoint.state_dict``). A collective under FSDP2: every rank must call it,
    and every rank gets the full state. ``full=False``: the same, FSDP2's sharded tensors left
    as this rank's DTensors (nothing gathered; what ``portrl.state_files.save_shard`` writes). Frozen parameters (a LoRA run's base model) are left
    out and not gathered: every worker loads them from the model at start and nothing changes them. An
    optimizer that has not stepped yet is saved as its hyperparameters only (torch's getter would initialise
    its state with a zero-gradient step, changing the next update)."""
    # here, not at the top: this module takes ~0.8 s to import and only checkpoints need it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict  # noqa: PLC0415  (FSDP: only in a sharded run)

    options = StateDictOptions(full_state_dict=full, ignore_frozen_params=True)
    model_state: dict[str, Any]
    optim_state: dict[str, Any]
    if not optimizer.state:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        model_state, optim_state = get_model_state_dict(model, options=options), {"state": {}, "param_groups": groups}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
    frozen = frozen_parameter_names(model)  # torch keeps the second name of a tied frozen weight (lm_head)
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def shard_wrap(model: nn.Module):
    """``wrap(local, shape, dim)`` for ``portrl.state_files.ShardedState.load``: a loaded shard as a DTensor on
    the mesh of ``model``'s sharded parameters, as FSDP2 places them (``Shard(dim)``)."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415  (FSDP: only in a sharded run)

    mesh = next(p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh"))

    def wrap(local: torch.Tensor, shape: tuple, dim: int):
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local.to(mesh.device_type), mesh, [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    return wrap


def load_full_train_state(model: nn.Module, optimizer, model_state: dict, optim_state: dict,
                          full: bool = True) -> None:
    """Load what :func:`full_train_state` returned (each rank keeps its shard of every full tensor); ``full=False``:
    what it returned with ``full=False`` (DTensors of this rank's rows, see :func:`shard_wrap`).

    Frozen parameters may be absent (they keep what the worker loaded); a trainable one may not: that state is
    of another model layout (say, without LoRA adapters), a ValueError naming the first missing ones.
    An optimizer that has not stepped yet has no state to load; torch's loader would then initialise it with
    a zero-gradient step (Adam's step count 1, changing the next update), so only the hyperparameters of its
    param groups are copied."""
    # not at the top: see full_train_state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict  # noqa: PLC0415  (FSDP: only in a sharded run)

    require_trainable(model, model_state)
    # sharded: torch's loader would want the frozen parameters too; require_trainable has checked the layout
    options = StateDictOptions(full_state_dict=full, ignore_frozen_params=True, strict=full)
    if optim_state.get("state"):
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
        return
    set_model_state_dict(model, model_state, options=options)
    for group, saved in zip(optimizer.param_groups, optim_state.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})
