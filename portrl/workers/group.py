"""WorkerGroup: N data-parallel copies of a worker class, in this process or as Ray actors.

``WorkerGroup(worker_cls, cfg, num_workers, backend)`` builds ``worker_cls(cfg_w, rank=r, world_size=N)`` for
every rank r through one of two launchers, chosen by :func:`use_ray` (the one rule for it):

* in-process (:class:`InProcessLauncher`): one worker in this process; every call is a direct method call
  (no Ray, no copies, no process group): the hot path of small runs;
* Ray (:class:`portrl.workers.ray_launcher.RayLauncher`): one Ray actor per rank, in a resource pool, with its
  device set and ``torch.distributed`` joined.

``cfg_w`` holds only the top-level config sections the worker class declares in its ``config_sections``
attribute (:func:`worker_config`); a class that declares none gets the whole config.

Every call runs ``method`` on every rank. The caller names the worker method itself, as in
``group.run(CriticWorker.save_shard, path, name)``: mypy checks it against the group's worker class
(``WorkerGroup[W]``: a method the class lacks is an error) and the arguments and result against its signature.
The group dispatches by the method's name (:func:`method_name`; Ray actors receive that name), so a subclass's
override runs. A name (str) is the untyped form, for stand-in worker classes. Each :class:`Batch` argument is cut
into N contiguous pieces (``Batch.chunk``) and rank r gets piece r; other arguments go to every rank as they are.
With ``replicas`` k > 1 (a model whose mesh has sequence or tensor parallelism: the k = sp x tp ranks of a
data-parallel group hold the same rows, portrl.workers.mesh) a Batch is cut into N / k pieces, rank r gets piece
r // k, and the Batches and metrics that come back are those of ranks 0, k, 2k, ...
What comes back is said by the method called, never guessed from the results:

* :meth:`WorkerGroup.gather`: every rank's result, a list in rank order;
* :meth:`WorkerGroup.concat`: every rank's Batch, concatenated in rank order;
* :meth:`WorkerGroup.metrics`: every rank's metric dict, reduced by :func:`reduce_metrics`;
* :meth:`WorkerGroup.rank0`: rank 0's result alone (worker state for a checkpoint: a state dict is never
  passed through a metrics reduction, which would, say, sum a counter over the ranks);
* :meth:`WorkerGroup.run`: nothing (a call made for its effect, such as loading a state).

A Ray worker process that dies makes every call raise :class:`WorkerDiedError` naming the worker (role, rank,
node, pid); the group's other actors are killed, since their collectives can no longer complete. With
``timeout_s`` set (seconds; the trainer sets it from ``trainer.worker_timeout_s``), a call whose results do
not all arrive in time raises :class:`WorkerTimeoutError` (a WorkerDiedError) naming the workers that did not
answer, and the group is shut down the same way (portrl.workers.ray_calls).
"""

from __future__ import annotations

import os
from typing import (TYPE_CHECKING, Any, Callable, Concatenate, Dict, Generic, List, Mapping, Optional, ParamSpec,
                    Sequence, TypeVar, overload)

from omegaconf import DictConfig, OmegaConf

from portrl.config.placement import placement_of
from portrl.errors import UserError
from portrl.workers.batch import Batch, concat_rollouts
from portrl.workers.ray_calls import WorkerDiedError, WorkerTimeoutError  # noqa: F401  (the group's errors)
from portrl.workers.ray_launcher import RayLauncher

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.device.backend import Backend

W = TypeVar("W", covariant=True)  # the group's worker class (a group of a subclass is a group of its base)
P = ParamSpec("P")  # the worker method's parameters after ``self``
R = TypeVar("R")  # the worker method's result

MAX_KEYS = ("max", "timing", "time/")
MIN_KEYS = ("min",)
SUM_KEYS = ("count", "num_tokens", "num_seqs", "/sum", "_sum")


def use_ray(cfg: PortRLConfig, num_workers: int) -> bool:
    """Whether a group of ``num_workers`` workers runs as Ray actors: ``trainer.use_ray`` when set, else Ray for
    several workers, a named cluster (``trainer.ray_address``) or ``rollout.placement=separated`` (the weight
    broadcast joins Ray actors). ``trainer.use_ray=false`` where Ray is needed is a UserError."""
    t = cfg.trainer
    placement = placement_of(cfg)
    if t.use_ray is not None and not t.use_ray and (num_workers > 1 or placement.needs_ray):
        why = f"{num_workers} workers" if num_workers > 1 else f"rollout.placement={placement.name}"
        raise UserError(f"trainer.use_ray=false, but {why} run as Ray actors; set trainer.use_ray=true or null, "
                        f"or use trainer.num_workers=1 with rollout.placement=colocated")
    if t.use_ray is not None:
        return bool(t.use_ray)
    return num_workers > 1 or bool(t.ray_address) or placement.needs_ray


def worker_config(worker_cls: Any, cfg: PortRLConfig) -> Any:
    """The config a worker of ``worker_cls`` is built with: a copy of ``cfg`` holding only the top-level sections
    named by ``worker_cls.config_sections`` (the whole ``cfg`` when the class declares none, or when ``cfg`` is
    not an OmegaConf config). A declared section the config lacks is an error naming it."""
    sections = getattr(worker_cls, "config_sections", None)
    if sections is None or not isinstance(cfg, DictConfig):
        return cfg
    missing = [s for s in sections if s not in cfg]
    if missing:
        raise ValueError(f"{getattr(worker_cls, '__name__', worker_cls)} reads config sections {missing}, which "
                         f"the config lacks; it has {list(cfg.keys())}")
    return OmegaConf.masked_copy(cfg, list(sections))


def _rule(key: str) -> str:
    k = key.lower()
    if any(s in k for s in MAX_KEYS):
        return "max"
    if any(s in k.rsplit("/", 1)[-1] for s in MIN_KEYS):
        return "min"
    if any(k.endswith(s) for s in SUM_KEYS):
        return "sum"
    return "mean"


def reduce_metrics(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Combine the metric dicts of the ranks into one.

    Lists are concatenated (rank order). Numbers (and one-element tensors) are reduced by key name: ``max`` when
    the name contains ``max`` or is a timing (``timing``, ``time/``: the slowest rank sets the pace), ``min``
    when the last path part contains ``min``, ``sum`` for counts (``count``, ``num_tokens``, ``num_seqs``,
    ``.../sum``), else the mean over ranks (ranks hold equal shares of the batch, up to one row). Other values
    are taken from rank 0.
    """
    out: Dict[str, Any] = {}
    keys: List[str] = []
    for d in per_rank:
        keys += [k for k in d if k not in keys]
    for k in keys:
        vals = [d[k] for d in per_rank if k in d]
        if all(isinstance(v, (list, tuple)) for v in vals):
            out[k] = [x for v in vals for x in v]
            continue
        nums: list[float] = []
        numeric = True
        for v in vals:
            if hasattr(v, "numel") and v.numel() == 1:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                numeric = False
                break
            nums.append(float(v))
        if not numeric:
            out[k] = vals[0]
            continue
        rule = _rule(k)
        out[k] = (max(nums) if rule == "max" else min(nums) if rule == "min" else
                  sum(nums) if rule == "sum" else sum(nums) / len(nums))
    return out


def concat_batches(per_rank: Sequence[Batch]) -> Batch:
    """The ranks' Batches in rank order as one; rollouts are padded to the widest prompt / response with
    ``info["pad_token_id"]`` (:func:`portrl.workers.batch.concat_rollouts`), since ranks' widths may differ."""
    if all("prompts" in r and "responses" in r for r in per_rank):
        return concat_rollouts(list(per_rank), int(per_rank[0].info.get("pad_token_id", 0)))
    return Batch.concat(list(per_rank))


def split_args(args: Sequence[Any], kwargs: Mapping[str, Any], n: int, replicas: int = 1) -> List[tuple]:
    """Per-rank ``(args, kwargs)`` of ``n`` ranks: each Batch cut into ``n / replicas`` contiguous pieces, rank r
    getting piece ``r // replicas`` (the sequence and tensor parallel ranks of a data-parallel group share rows);
    other values repeated."""
    if replicas > 1:
        return [p for p in split_args(args, kwargs, n // replicas) for _ in range(replicas)]
    pieces: Dict[Any, List[Batch]] = {}
    for key, v in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(v, Batch):
            if len(v) < n:
                raise ValueError(f"cannot split a batch of {len(v)} rows over {n} data-parallel workers; "
                                 f"give each worker at least one row (batch size >= {n})")
            pieces[key] = v.chunk(n)
    out = []
    for r in range(n):
        a = tuple(pieces[i][r] if i in pieces else v for i, v in enumerate(args))
        kw = {k: pieces[k][r] if k in pieces else v for k, v in kwargs.items()}
        out.append((a, kw))
    return out


def method_name(worker_cls: Any, method: Callable[..., Any] | str) -> str:
    """The name ``method`` is dispatched by on a worker of ``worker_cls``: ``method`` itself when it is a name, else
    ``method.__name__`` when the class has it (a base class's or a protocol's method runs as the class's own), else
    the name under which the class holds that very function (set there under another name, as a test's spy is)."""
    if isinstance(method, str):
        return method
    name = method.__name__
    if hasattr(worker_cls, name):
        return name
    for attr in dir(worker_cls):
        if getattr(worker_cls, attr, None) is method:
            return attr
    raise AttributeError(f"{getattr(worker_cls, '__name__', worker_cls)} has no method {name!r}")


class InProcessLauncher:
    """One worker in this process: ``execute`` is ``getattr(worker, method)(*args, **kwargs)``."""

    uses_ray = False

    def __init__(self, worker: Any):
        self.worker = worker
        self.info = [{"node_ip": "local", "node_id": "", "pid": os.getpid()}]

    def execute(self, method: str, per_rank: Sequence[tuple], reply: Sequence[bool]) -> List[Any]:
        args, kwargs = per_rank[0]
        return [getattr(self.worker, method)(*args, **kwargs)]

    def submit(self, method: str, per_rank: Sequence[tuple], reply: Sequence[bool]) -> List[Any]:
        return self.execute(method, per_rank, reply)  # in this process a call cannot run beside the caller

    def collect(self, results: Sequence[Any], method: str = "") -> List[Any]:
        return list(results)

    def full_weights(self) -> Dict[str, Any]:
        return {n: t.detach().cpu() for n, t in self.worker.named_weights()}

    def shutdown(self) -> None:
        self.worker = None


class WorkerGroup(Generic[W]):
    """N data-parallel workers of one role (see the module docstring).

    ``pool``: a :class:`~portrl.workers.ray_env.ResourcePool` for the Ray launcher (default: a new one of
    ``num_workers`` bundles of 1 CPU + 1 device; a pinned worker's bundle holds its cores instead of 1 CPU).
    ``share``: how many groups share each bundle of ``pool`` (colocation: each asks for 1/share of it).
    ``share_devices``: set the backend's Ray no-set opt-outs (see ``ray_env``). ``worker_kwargs``: extra keyword
    arguments of the worker's constructor.
    """

    def __init__(self, worker_cls: type[W], cfg, num_workers: int, backend: Backend, *, role: Optional[str] = None,
                 pool=None, share: int = 1, share_devices: bool = False,
                 worker_kwargs: Optional[Mapping[str, Any]] = None, replicas: int = 1):
        if num_workers < 1:
            raise ValueError(f"WorkerGroup: num_workers must be >= 1, got {num_workers}")
        if num_workers % replicas:
            raise ValueError(f"WorkerGroup: {num_workers} workers do not form groups of {replicas} replicas")
        self.replicas = int(replicas) if num_workers > 1 else 1
        self.role, self.worker_cls = role or getattr(worker_cls, "__name__", "worker"), worker_cls
        self.num_workers, self.backend = int(num_workers), backend
        self.timeout_s: Optional[float] = None  # limit on each call's answers (module docstring); None = none
        self.use_ray = use_ray(cfg, self.num_workers)
        wcfg, kwargs = worker_config(worker_cls, cfg), dict(worker_kwargs or {})
        self.launcher: RayLauncher | InProcessLauncher
        if self.use_ray:
            self.launcher = RayLauncher(self, pool=pool, share=share, share_devices=share_devices)
            self.launcher.start(worker_cls, cfg, wcfg, kwargs)
        else:
            build: Callable[..., W] = worker_cls  # the constructor every worker class has (W says nothing of it)
            self.launcher = InProcessLauncher(build(wcfg, rank=0, world_size=1, **kwargs))
        self._all = [True] * self.num_workers
        self._leaders = [r % self.replicas == 0 for r in range(self.num_workers)]  # one rank per piece of rows
        self._none = [False] * self.num_workers
        self._first = [True] + [False] * (self.num_workers - 1)
        self._names: Dict[Callable[..., Any] | str, str] = {}  # method -> the name it is dispatched by (method_name)

    # ------------------------------------------------------------------------------ dispatch
    def _execute(self, method: Callable[..., Any] | str, args: tuple, kwargs: dict, reply: List[bool]) -> List[Any]:
        name = self._names.get(method)  # the hot path: one lookup
        if name is None:
            name = self._names[method] = method_name(self.worker_cls, method)
        per_rank = [(args, kwargs)] if self.num_workers == 1 else split_args(args, kwargs, self.num_workers,
                                                                              self.replicas)
        return self.launcher.execute(name, per_rank, reply)

    def _of_leaders(self, results: List[Any]) -> List[Any]:
        """The results of one rank per piece of rows (all ranks without sequence or tensor parallelism)."""
        return results if self.replicas == 1 else results[::self.replicas]

    @overload
    def gather(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> List[R]: ...
    @overload
    def gather(self, method: str, *args: Any, **kwargs: Any) -> List[Any]: ...

    def gather(self, method: Any, *args: Any, **kwargs: Any) -> List[Any]:
        """Every rank's result, in rank order."""
        return self._execute(method, args, kwargs, self._all)

    @overload
    def concat(self, method: Callable[Concatenate[W, P], Batch], *args: P.args, **kwargs: P.kwargs) -> Batch: ...
    @overload
    def concat(self, method: str, *args: Any, **kwargs: Any) -> Batch: ...

    def concat(self, method: Any, *args: Any, **kwargs: Any) -> Batch:
        """Every rank's Batch, concatenated in rank order (:func:`concat_batches`); with replicas, one rank's per
        piece of rows."""
        results = self._of_leaders(self._execute(method, args, kwargs, self._leaders))
        if not all(isinstance(r, Batch) for r in results):
            name = method_name(self.worker_cls, method)
            raise TypeError(f"{self.role}.{name} returned {type(results[0]).__name__}, not a Batch; "
                            f"use gather / rank0 for other results")
        return results[0] if len(results) == 1 else concat_batches(results)

    @overload
    def metrics(self, method: Callable[Concatenate[W, P], Mapping[str, Any]], *args: P.args,
                **kwargs: P.kwargs) -> Dict[str, Any]: ...
    @overload
    def metrics(self, method: str, *args: Any, **kwargs: Any) -> Dict[str, Any]: ...

    def metrics(self, method: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Every rank's metric dict, reduced over the ranks (:func:`reduce_metrics`); with replicas, over one rank
        per piece of rows (a replica's counts would otherwise be summed twice)."""
        results = self._of_leaders(self._execute(method, args, kwargs, self._leaders))
        if not all(isinstance(r, Mapping) for r in results):
            name = method_name(self.worker_cls, method)
            raise TypeError(f"{self.role}.{name} returned {type(results[0]).__name__}, not a metrics dict")
        return results[0] if len(results) == 1 else reduce_metrics(results)

    @overload
    def rank0(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def rank0(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def rank0(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Rank 0's result of a call every rank makes (collectives need them all); the other ranks' results stay in
        their processes."""
        return self._execute(method, args, kwargs, self._first)[0]

    @overload
    def run(self, method: Callable[Concatenate[W, P], object], *args: P.args, **kwargs: P.kwargs) -> None: ...
    @overload
    def run(self, method: str, *args: Any, **kwargs: Any) -> None: ...

    def run(self, method: Any, *args: Any, **kwargs: Any) -> None:
        """The call on every rank, for its effect; no result comes back."""
        self._execute(method, args, kwargs, self._none)

    @overload
    def submit(self, method: Callable[Concatenate[W, P], Batch], *args: P.args,
               **kwargs: P.kwargs) -> PendingCall: ...
    @overload
    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall: ...

    def submit(self, method: Any, *args: Any, **kwargs: Any) -> PendingCall:
        """Start ``method`` on every rank (as :meth:`concat` does) and return at once; the
        :class:`PendingCall`'s ``batch()`` waits for the Batch. Ray workers run it while this process goes on; an
        in-process worker has already run it when this returns."""
        name = method_name(self.worker_cls, method)
        per_rank = [(args, kwargs)] if self.num_workers == 1 else split_args(args, kwargs, self.num_workers,
                                                                              self.replicas)
        return PendingCall(self, name, self.launcher.submit(name, per_rank, self._leaders))

    def full_weights(self) -> Dict[str, Any]:
        """The workers' ``named_weights()`` as full CPU tensors, from rank 0 (every rank joins the gather)."""
        return self.launcher.full_weights()

    # ------------------------------------------------------------------------------ facts
    @property
    def info(self) -> List[Dict[str, Any]]:
        """Per rank: ``node_ip``, ``node_id``, ``pid`` (and, on Ray, the accelerator ids it was given, the
        ``cores`` it runs on and its torch ``threads``: a separated run's pinned set, see
        :func:`portrl.workers.placement.group_pinning`)."""
        return self.launcher.info

    @property
    def local_worker(self) -> Any:
        """The in-process worker (None when the workers are Ray actors)."""
        return self.launcher.worker if isinstance(self.launcher, InProcessLauncher) else None

    def describe(self, rank: int) -> str:
        """``"<role> rank <r> on node <ip> (node id <id8>, pid <pid>)"``."""
        if rank >= len(self.info):
            return f"{self.role} rank {rank}"
        i = self.info[rank]
        return f"{self.role} rank {rank} on node {i['node_ip']} (node id {str(i['node_id'])[:8]}, pid {i['pid']})"

    def shutdown(self) -> None:
        """Stop the workers: kill Ray actors and release an own resource pool (idempotent)."""
        self.launcher.shutdown()


class PendingCall:
    """A call :meth:`WorkerGroup.submit` started on every rank; :meth:`batch` waits for its Batch (once)."""

    def __init__(self, group: WorkerGroup, method: str, handles: List[Any]):
        self.group, self.method, self._handles = group, method, handles
        self._result: Optional[Batch] = None

    def batch(self) -> Batch:
        """Every rank's Batch, concatenated in rank order (as :meth:`WorkerGroup.concat`)."""
        if self._result is None:
            results = self.group._of_leaders(self.group.launcher.collect(self._handles, self.method))
            if not all(isinstance(r, Batch) for r in results):
                raise TypeError(f"{self.group.role}.{self.method} returned {type(results[0]).__name__}, not a Batch")
            self._result = results[0] if len(results) == 1 else concat_batches(results)
        return self._result
