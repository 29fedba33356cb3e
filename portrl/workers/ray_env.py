"""Ray setup: starting or joining a cluster, worker environments, resource pools, device visibility.

Nothing here runs on import. Ray is imported inside the functions that use it: a run in one process never
uses Ray, and importing it costs ~0.4 s (and :func:`shutdown_ray` only touches a Ray that is already imported).

Visible devices -- what each worker sees:

* ``backend.ray_resource is None`` (the CPU): workers ask Ray for CPUs only; no device variable is set.
* Default: a worker asks for ``devices_per_worker`` of ``backend.ray_resource`` and Ray sets
  ``backend.visible_devices_env`` in that worker to exactly the ids it was given (e.g. ``"1"``), so the
  worker sees only its own device(s) and uses local index 0 (:func:`local_device_index`).
* ``share_devices=True`` (needed when one process drives several devices, or an engine wants to see them
  all): the ``backend.ray_noset_env`` opt-outs are set to ``"1"`` in the worker's environment, Ray leaves
  the visible-devices variable as the node had it, and the worker picks its device by the id Ray gave it,
  mapped through that variable (:func:`local_device_index`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from portrl import process_env
from portrl.workers import ray_watchdog

if TYPE_CHECKING:  # the Ray layer names the Backend and config types only in annotations
    from portrl.config.schema import PortRLConfig
    from portrl.device.backend import Backend

log = logging.getLogger(__name__)


def _cfg_get(cfg: PortRLConfig, dotted: str, default: Any = None) -> Any:
    node: Any = cfg  # a walk by name: a key a partial config lacks reads as the default
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part, None) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def worker_env(cfg: PortRLConfig, backend: Backend, *, share_devices: bool = False) -> Dict[str, str]:
    """Environment variables of every worker: the variables torch reads before it loads, as they are in effect
    here with ``device.env`` on top (``portrl.process_env.current``: a wait policy there drops the default spin
    count), ``backend.env_presets(trainer.deterministic)``, then ``device.env`` (the user's, wins), then the Ray
    no-set opt-outs when ``share_devices``."""
    user = {str(k): str(v) for k, v in dict(_cfg_get(cfg, "device.env", {}) or {}).items()}
    env = process_env.current({**os.environ, **user})
    env.update(backend.env_presets(deterministic=bool(_cfg_get(cfg, "trainer.deterministic", False))))
    env.update(user)
    if share_devices:
        env.update({name: "1" for name in backend.ray_noset_env})
    return env


def init_ray(cfg: PortRLConfig, backend: Backend, *, num_cpus: Optional[int] = None, num_gpus: Optional[int] = None,
             resources: Optional[Dict[str, float]] = None) -> None:
    """Start a local Ray on 127.0.0.1, or join ``trainer.ray_address`` (a cluster built with ``ray start`` on
    each node). No dashboard unless ``trainer.ray_dashboard`` (then bound to 127.0.0.1). Every worker of the
    job gets :func:`worker_env` through the job's runtime_env. A no-op when Ray is already initialised.

    A local Ray gets a watchdog (portrl.workers.ray_watchdog) that ends its processes when this process ends,
    however it ends. ``ray.init`` replaces the SIGTERM handler with its own (``sys.exit``); a handler the caller
    had installed (the trainer's, portrl.trainer.interrupts) is put back.

    ``num_cpus`` / ``num_gpus`` / ``resources`` size a *local* Ray only (tests; ignored when joining).
    """
    import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

    if ray.is_initialized():
        return
    address = _cfg_get(cfg, "trainer.ray_address")
    dashboard = bool(_cfg_get(cfg, "trainer.ray_dashboard", False))
    common: dict[str, Any] = dict(include_dashboard=dashboard, runtime_env={"env_vars": worker_env(cfg, backend)},
                  log_to_driver=True, configure_logging=False)
    if dashboard:
        common["dashboard_host"] = "127.0.0.1"
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if address:
            log.info("joining the Ray cluster at %s", address)
            ray.init(address=str(address), **common)
            return
        _loopback_only()
        _patient_local_start()
        ray_watchdog.start(os.path.dirname(ray.__file__))  # before ray.init: a driver killed meanwhile is covered
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus, num_gpus=num_gpus,
                 resources=resources, **common)
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    log.info("started a local Ray on 127.0.0.1 (dashboard %s)", "on" if dashboard else "off")


def shutdown_ray() -> None:
    """Disconnect from Ray, stopping a local Ray this process started and every worker of the job; a no-op when
    Ray is not running here. For a run that stops early: unlike removing placement groups, ``ray.shutdown``
    returns (within seconds) even when Ray's own processes are gone already, as after a SIGTERM sent to the
    whole process group (systemd, Slurm), which reaches them too."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def terminate_local_ray(wait_s: float = 0.0) -> None:
    """Send SIGTERM to the processes of a local Ray this process started (raylet, GCS, ...) and to the raylet's
    children, waiting at most ``wait_s`` for them: for a driver about to end at once (``os._exit``), whose
    ``ray.shutdown`` at exit will not run. By default it does not wait: Ray's client in this process ends it
    with exit code 1 once it sees the raylet gone, and what is left when the driver ends, the watchdog ends
    (portrl.workers.ray_watchdog)."""
    ray = sys.modules.get("ray")
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    procs = [info.process for infos in (getattr(node, "all_processes", None) or {}).values() for info in infos]
    # the raylet's own children (its agents) too: they outlive a raylet that cannot finish draining
    children = [c for p in procs for c in ray_watchdog.children(p.pid)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _loopback_only() -> None:
    """Make a local Ray use 127.0.0.1 as its node address.

    Ray turns ``_node_ip_address="127.0.0.1"`` into the host's routable address unless its single-machine mode
    is on (``ray_constants.ENABLE_RAY_CLUSTER`` false, read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the
    default on desktops). The variable reaches the processes Ray starts; the constant is set here because this
    process imported Ray already. Only for a local Ray: joining a cluster leaves both alone.
    """
    from ray._private import ray_constants  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


LOCAL_START_WAIT_S = 120


def _patient_local_start() -> None:
    """Give a local Ray's GCS :data:`LOCAL_START_WAIT_S` seconds to write its port file and answer, not Ray's
    30 s, for a loaded 2-core host (a test suite beside a run). (The "Timed out waiting for file
    .../gcs_server_port_..." failures CI saw were a GCS killed at birth by the watchdog of an earlier Ray of the
    same process, fixed in :func:`portrl.workers.ray_watchdog.retire_previous`, not a slow one.) Ray reads the
    wait from ``RAY_gcs_server_port_wait_time_s`` in this process; a value the user set is kept."""
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(LOCAL_START_WAIT_S))


def local_device_index(backend: Backend, accelerator_ids: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The device index this worker should use (None on a backend without a Ray resource).

    ``accelerator_ids``: what Ray gave the worker (``ray.get_runtime_context().get_accelerator_ids()
    [backend.ray_resource]``). When Ray set the visible-devices variable to exactly these ids, the worker's
    own first device is index 0. Under the no-set opt-outs the variable lists the node's devices; the index is
    the position of the worker's first id in that list (or the id itself when the variable is unset).
    """
    if backend.ray_resource is None:
        return None
    environ = os.environ if environ is None else environ
    if not accelerator_ids:
        raise RuntimeError(f"this worker was given no {backend.ray_resource} by Ray; ask for devices_per_worker > 0")
    first = str(accelerator_ids[0])
    visible = environ.get(backend.visible_devices_env or "", None)
    noset = any(environ.get(v) for v in backend.ray_noset_env)
    if not noset:
        return 0
    if visible is None or visible == "":
        return int(first)
    listed = [v.strip() for v in visible.split(",")]
    if first not in listed:
        raise RuntimeError(f"device id {first} given by Ray is not in {backend.visible_devices_env}={visible!r}")
    return listed.index(first)


@dataclass
class ResourcePool:
    """A Ray placement group of ``num_workers`` bundles, each ``{"CPU": cpus_per_worker, resource: devices}``.

    ``strategy``: Ray's placement strategy -- ``PACK`` fills a node before using the next (a pool larger
    than one node spans several), ``SPREAD`` puts bundles on different nodes where it can, ``STRICT_*`` as
    Ray defines them. Several worker groups may share one pool (colocation) by asking for a fraction of each
    bundle (``WorkerGroup(..., pool=pool, share=k)``).
    """

    name: str
    num_workers: int
    backend: Backend
    cpus_per_worker: float = 1.0
    devices_per_worker: float = 1.0
    strategy: str = "PACK"
    timeout_s: float = 60.0

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"resource pool {self.name!r}: num_workers must be >= 1, got {self.num_workers}")
        self.placement_group = None

    def bundle(self) -> Dict[str, float]:
        b = {"CPU": float(self.cpus_per_worker)}
        if self.backend.ray_resource is not None and self.devices_per_worker > 0:
            b[self.backend.ray_resource] = float(self.devices_per_worker)
        return b

    def create(self):
        """Reserve the bundles (waits up to ``timeout_s``; a pool that cannot fit is an error naming what it
        asked for and what the cluster has)."""
        import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)
        from ray.util.placement_group import placement_group  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        if self.placement_group is not None:
            return self.placement_group
        bundles = [self.bundle() for _ in range(self.num_workers)]
        pg = placement_group(bundles, strategy=self.strategy, name=f"portrl_{self.name}_{os.getpid()}")
        ready, _ = ray.wait([pg.ready()], timeout=self.timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name!r} could not reserve {self.num_workers} x {self.bundle()} "
                f"(strategy {self.strategy}) within {self.timeout_s:.0f}s; the cluster has {ray.cluster_resources()}")
        self.placement_group = pg
        return pg

    def scheduling(self, rank: int):
        """The scheduling strategy that puts worker ``rank`` into bundle ``rank``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        return PlacementGroupSchedulingStrategy(placement_group=self.create(), placement_group_bundle_index=rank,
                                                placement_group_capture_child_tasks=True)

    def remove(self) -> None:
        import ray  # noqa: PLC0415  (ray: slow to import; only where Ray runs)

        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
