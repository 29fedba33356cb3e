"""The Backend contract: one subclass per vendor, living in ``backends/<name>/``.

A backend is mostly *data* (identity, Ray facts, env presets, compatibility rows) plus a few
small methods. Heavy parts (the torch device module, vendor kernels) are resolved lazily, so
constructing a backend or calling :meth:`Backend.probe` never initialises a device runtime.

Method families:

* identity: ``name``, ``device_type``, ``dist_backend``, ``ray_resource``,
  ``visible_devices_env``, ``ray_noset_env``, ``detect_priority``, ``weight_transports``
* probe: :meth:`probe` -> :class:`ProbeResult`; :meth:`host_shows_device` (the host's own evidence of a device of
  this kind: device nodes, read without importing anything) and :meth:`no_device_here`, which a vendor's probe
  returns first, so that a host without such a device is told so, not how to install the vendor's packages
* device and memory: :meth:`device`, :meth:`device_count`, :meth:`set_device`,
  :meth:`synchronize`, :meth:`configure_allocator`, :meth:`empty_cache`, :meth:`memory_stats`,
  :meth:`reset_peak_memory`, :meth:`memory_available`, :meth:`manual_seed`
* dtypes: :meth:`supported_dtypes`, :meth:`supports_bf16`, :meth:`fp8_dtype`
* required answers (:data:`REQUIRED_ANSWERS`: bf16, fp8 and memory): no default here, since a default would be one
  vendor's answer given silently to another; a backend class lacking one is refused when it registers
  (:func:`missing_answers`). A device whose torch module tracks memory answers with :func:`torch_memory_stats`
  and :func:`torch_memory_available`
* kernels: :meth:`register_kernels` (called once with the ops registry),
  :meth:`kernel_preferences` (op name -> implementation names, best first), :meth:`decode_kernel` (the hf
  engine's fast decoder's KV cache layout and what the backend runs its own way in a decode step)
* rollout engines: :meth:`rollout_engines`, :meth:`check_and_update_engine_options`
* placement: :meth:`split_compute` (a separated run's trainer and rollout workers on disjoint devices or cores)
* peaks: ``device_models`` (the peak table), :meth:`device_name`, :meth:`peak_throughput` (portrl/device/peaks.py)
* profiling: :meth:`step_profiler` (one step's trace, ``trainer.profile.steps``), ``profiler_activities``,
  :meth:`range_push` / :meth:`range_pop` (the vendor's range API around each phase: ``range_api``)
* environment: :meth:`env_presets`; what a config's ``device.env`` may set: ``declared_env``,
  ``refused_env``, :meth:`accepted_env`, :meth:`env_refusals`
* compatibility: ``compat_rows`` and :meth:`installed_versions`, checked by ``portrl doctor``
  together with :meth:`doctor_checks` (this backend's known traps) and :meth:`host_checks`
  (traps this backend's packages set for *any* backend on the host)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from abc import abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Protocol

from portrl.device.peaks import DeviceModel, PeakThroughput, model_of_name, named_model
from portrl.device.profiler import TorchStepProfiler
from portrl.device.split import ComputeSplit
from portrl.device.versions import CompatRow, package_version

if TYPE_CHECKING:  # torch is imported lazily (module docstring)
    import torch

    from portrl.device.checks import Check
    from portrl.device.decode_kernel import DecodeKernel


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend can run here. ``reason`` says why not (empty when usable)."""

    usable: bool
    reason: str = ""
    device_count: int = 0
    device_name: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)


def module_available(module: str) -> bool:
    """True when ``module`` can be found on the path; never imports it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_NO_CODE = "a config cannot load code"

#: what the dynamic loader, the Python interpreter and the shell load or run from the environment (ld.so(8),
#: python(1) "Environment variables", glibc's iconv, bash(1)): refused on every backend (``Backend.env_refusals``)
PROCESS_REFUSED_ENV: Mapping[str, str] = {
    "LD_PRELOAD": f"it names native libraries the dynamic loader maps into every process first; {_NO_CODE}",
    "LD_LIBRARY_PATH": f"it names folders the dynamic loader searches first, so a library there replaces the "
                       f"installed one; {_NO_CODE}",
    "LD_AUDIT": f"it names native libraries the dynamic loader runs as auditors of every process; {_NO_CODE}",
    "PYTHONPATH": f"it puts folders before the installed packages on Python's import path; {_NO_CODE}",
    "PYTHONHOME": f"it moves Python's standard library to the folder it names; {_NO_CODE}",
    "PYTHONSTARTUP": f"it names a Python file the interpreter runs when it starts interactively; {_NO_CODE}",
    "PYTHONUSERBASE": f"it names the user site folder whose packages and .pth files Python imports; {_NO_CODE}",
    "PYTHONPYCACHEPREFIX": f"it names the folder Python reads compiled modules from; {_NO_CODE}",
    "PYTHONWARNINGS": f"its filters name warning classes by module, which Python imports at start; {_NO_CODE}",
    "PYTHONBREAKPOINT": "it names the callable breakpoint() runs, a debugger; a config attaches no debugger",
    "PYTHONINSPECT": "it leaves an interactive prompt open when the program ends; a config attaches no debugger",
    "PATH": f"it chooses the executables (compilers, tools) a worker runs; {_NO_CODE}",
    "GCONV_PATH": f"it names folders of native modules glibc loads to convert character sets; {_NO_CODE}",
    "BASH_ENV": f"it names a script every non-interactive bash runs first; {_NO_CODE}",
}


#: a rollout engine's constructor options in its own terms (option name -> value of the option's own type)
EngineOptions = dict[str, object]


class KernelRegistry(Protocol):
    """What :meth:`Backend.register_kernels` receives: the ops registry (the module ``portrl.ops.registry``)."""

    def register(self, op: str, impl: str, fn: Callable[..., object],
                 available: Callable[[], bool | str] | None = None) -> None:
        """Register ``fn`` as implementation ``impl`` of ``op`` (``available``: can it run here?)."""


class Backend:
    """Base class of every device backend. Subclasses set the class attributes and override where the vendor differs."""

    # --- identity -------------------------------------------------------------------------
    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # torch's device type (a vendor may reuse another's, see backends/)
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed process-group backend
    ray_resource: ClassVar[str | None] = None  # Ray resource name (e.g. "GPU"), None for none
    visible_devices_env: ClassVar[str | None] = None  # variable that Ray sets for each worker
    ray_noset_env: ClassVar[tuple[str, ...]] = ()  # opt-outs that stop Ray setting the variable
    detect_priority: ClassVar[int] = 0  # higher is tried first by detection ("auto")
    #: weight transports to separated rollout workers this backend offers, best first (names registered in
    #: portrl/device/weight_transport.py; ``broadcast`` runs over ``dist_backend``)
    weight_transports: ClassVar[tuple[str, ...]] = ("broadcast",)
    #: distributions whose versions `portrl devices` and `doctor` report
    version_packages: ClassVar[tuple[str, ...]] = ("torch",)
    #: version rows this backend is known to work with (newest first)
    compat_rows: ClassVar[tuple[CompatRow, ...]] = ()
    #: (installed distribution, PEP 508 requirement it needs, fix) checked by ``portrl doctor``,
    #: e.g. ``("some-engine", "transformers<5.20", "pip install 'transformers<5.20'")``
    version_constraints: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    #: the exact environment variables a config's ``device.env`` may set for this backend, besides the keys of
    #: :meth:`env_presets`: each a plain setting of its runtime (no prefixes: a prefix lets through the
    #: variables of the same runtime that load a library, a plugin or a hook)
    declared_env: ClassVar[tuple[str, ...]] = ()
    #: variables ``device.env`` may never set, each with why (a clause after "is not accepted: "): what loads
    #: native code, imports Python, attaches a debugger or is managed by Ray and portrl, besides
    #: ``PROCESS_REFUSED_ENV``. Refused even where a backend declares them; anything not accepted
    #: (:meth:`accepted_env`) is refused anyway, these only say why
    refused_env: ClassVar[Mapping[str, str]] = {}

    # --- probe ------------------------------------------------------------------------------
    def probe(self) -> ProbeResult:
        """Is this backend usable here, and if not, why? Must not initialise a device runtime."""
        raise NotImplementedError

    def host_shows_device(self) -> tuple[bool | None, str]:
        """Whether this host shows a device of this backend's kind, from the host alone (its device nodes; nothing
        imported, no runtime started): ``(True, "")``; ``(False, what is missing)``, e.g. ``"no /dev/xyz<N> device
        nodes: ..."``; ``(None, "")`` when the host cannot tell (the default)."""
        return None, ""

    def no_device_here(self) -> ProbeResult | None:
        """The probe result of a host that shows no device of this kind (:meth:`host_shows_device` is False): not
        usable, "this host has no <name> device (<what is missing>)", before any package is looked at (installing
        one would not help); None when the host shows one or cannot tell. A vendor's :meth:`probe` calls it first."""
        shown, missing = self.host_shows_device()
        if shown is not False:
            return None
        return ProbeResult(False, f"this host has no {self.name} device ({missing})", versions=self.installed_versions())

    def installed_versions(self) -> dict[str, str]:
        """Versions of ``version_packages`` that are installed (metadata only, no imports)."""
        found = {p: package_version(p) for p in self.version_packages}
        return {p: v for p, v in found.items() if v is not None}

    # --- device and memory ------------------------------------------------------------------
    def _module(self) -> ModuleType:
        """torch's per-device module (``torch.get_device_module(device_type)``), resolved lazily.

        Backends whose device module only exists after importing a plugin package override this.
        """
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        return torch.get_device_module(self.device_type)

    def device(self, index: int | None = None) -> torch.device:
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        if self.device_type == "cpu" or index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        return int(self._module().device_count())

    def set_device(self, index: int) -> None:
        self._module().set_device(index)

    def synchronize(self) -> None:
        self._module().synchronize()

    def configure_allocator(self) -> None:
        """Set up this process's allocator for the device's tensors, once, before the first one (GPU caching
        allocators read their settings from ``env_presets``: nothing to do here)."""

    def empty_cache(self) -> None:
        self._module().empty_cache()

    # memory_stats, reset_peak_memory, memory_available: answers every backend gives itself (REQUIRED_ANSWERS); a
    # device whose torch module tracks its memory answers with torch_memory_stats / torch_memory_available
    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Allocated / reserved / peak bytes on the current device (empty where not tracked)."""
        raise NotImplementedError(f"backend {self.name!r} does not answer memory_stats")

    @abstractmethod
    def reset_peak_memory(self) -> None:
        """Restart ``memory_stats()["peak_allocated"]`` from what is allocated now (per-phase peaks)."""
        raise NotImplementedError(f"backend {self.name!r} does not answer reset_peak_memory")

    @abstractmethod
    def memory_available(self) -> int | None:
        """Bytes the current device could still allocate now, None where the device does not say."""
        raise NotImplementedError(f"backend {self.name!r} does not answer memory_available")

    def manual_seed(self, seed: int) -> None:
        """Seed torch on the host and on every device of this backend."""
        import torch  # noqa: PLC0415  (torch: the doctor runs without it)

        torch.manual_seed(seed)
        if self.device_type != "cpu":
            self._module().manual_seed_all(seed)

    # --- dtypes -----------------------------------------------------------------------------
    def supported_dtypes(self) -> tuple[str, ...]:
        """Training dtypes in order of preference (torch dtype names)."""
        return ("bfloat16", "float16", "float32") if self.supports_bf16() else ("float16", "float32")

    @abstractmethod
    def supports_bf16(self) -> bool:
        """Whether the device computes bfloat16 natively (bf16 may still run where it is emulated, slowly)."""
        raise NotImplementedError(f"backend {self.name!r} does not answer supports_bf16")

    @abstractmethod
    def fp8_dtype(self) -> str | None:
        """The fp8 e4m3 dtype this device computes with (e.g. ``"float8_e4m3fn"``), or None without fp8."""
        raise NotImplementedError(f"backend {self.name!r} does not answer fp8_dtype")

    # --- kernels ------------------------------------------------------------------------------
    def register_kernels(self, registry: KernelRegistry) -> None:
        """Register this backend's op implementations into ``registry`` (portrl.ops). Imports stay lazy."""

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        """Op name -> implementation names, best first. The first that can run here is chosen."""
        return {}

    def decode_kernel(self) -> DecodeKernel:
        """The fast decoder's KV cache layout and capabilities on this backend (portrl/device/decode_kernel.py): the
        plain-torch one unless the backend has its own."""
        from portrl.device.decode_kernel import DecodeKernel  # noqa: PLC0415  (torch, lazily: module docstring)

        return DecodeKernel()

    # --- rollout engines ----------------------------------------------------------------------
    def rollout_engines(self) -> tuple[str, ...]:
        """Rollout engine names this backend offers, best first ("hf" runs everywhere)."""
        return ("hf",)

    def check_and_update_engine_options(self, engine: str, options: EngineOptions) -> EngineOptions:
        """Adjust the constructor options of rollout engine ``engine`` for this platform and return them.

        ``options`` are already in the engine's own terms (its translation of
        :class:`portrl.rollout.settings.RolloutSettings`, then the caller's keywords); what this returns is final.
        Override to force or refuse what the platform needs (raise ``UserError`` naming the option); the default
        returns them unchanged.
        """
        return options

    # --- placement ----------------------------------------------------------------------------
    def split_compute(self, trainer_workers: int, rollout_workers: int,
                      rollout_cores: int | None = None) -> ComputeSplit:
        """How this node's compute is divided between ``trainer_workers`` trainer workers and ``rollout_workers``
        rollout workers of a separated run (``rollout.placement=separated``).

        The accelerators split *devices*: each worker's Ray bundle holds ``devices_per_worker`` of
        ``ray_resource`` of its own (:class:`portrl.workers.ray_env.ResourcePool`), so the trainer's pool and the
        rollout pool already run on different devices and nothing is pinned; ``rollout_cores``
        (``rollout.cpu_cores``) is the CPU backend's and is ignored here. The CPU backend splits cores
        (backends/cpu/cores.py). A request that cannot be met (more cores than exist) is a ``UserError``.
        """
        return ComputeSplit("devices", why=f"each worker's Ray bundle holds {self.ray_resource or 'device'}s "
                                           "of its own")

    # --- environment --------------------------------------------------------------------------
    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        """Environment variables every worker process of this backend gets (allocator, comms, determinism)."""
        return {}

    def env_refusals(self) -> dict[str, str]:
        """Variable -> why a config may not set it: ``PROCESS_REFUSED_ENV``, the variable Ray sets for each worker
        (``visible_devices_env``), the opt-outs portrl sets (``ray_noset_env``) and ``refused_env``."""
        refusals = dict(PROCESS_REFUSED_ENV)
        if self.visible_devices_env:
            refusals[self.visible_devices_env] = ("Ray sets it for each worker to the devices it assigned; choose "
                                                  "the devices in the shell that starts portrl")
        for name in self.ray_noset_env:
            refusals[name] = "portrl sets it when workers share devices; a config leaves it to portrl"
        return {**refusals, **self.refused_env}

    def env_value_problems(self, env: Mapping[str, str]) -> list[str]:
        """One line per value ``device.env`` gives a variable this backend reads itself that it would refuse at run
        time (name, value, the valid values); none by default."""
        return []

    def accepted_env(self) -> frozenset[str]:
        """The variables ``device.env`` may set for this backend: ``declared_env`` and the keys of
        :meth:`env_presets` (both modes), less :meth:`env_refusals`."""
        names = set(self.declared_env) | set(self.env_presets(deterministic=False)) | set(self.env_presets(True))
        return frozenset(names - set(self.env_refusals()))

    # --- profiling ----------------------------------------------------------------------------
    #: torch.profiler.ProfilerActivity members beside CPU that record this backend's device work
    profiler_activities: ClassVar[tuple[str, ...]] = ()
    range_api: ClassVar[str] = ""  # the vendor range API of range_push / range_pop ("" = none), for docs and logs

    def step_profiler(self, trace_dir: str | os.PathLike, name: str) -> AbstractContextManager:
        """A context manager that records the work inside it and writes the trace as ``<trace_dir>/<name>.json``
        (portrl.device.profiler.TorchStepProfiler); a vendor whose profiler is its own overrides this."""
        return TorchStepProfiler(trace_dir, name, self.profiler_activities)

    def range_push(self, name: str) -> None:
        """Open a named range of the vendor's range API (seen by its system profiler); nothing by default."""

    def range_pop(self) -> None:
        """Close the range :meth:`range_push` opened last."""

    # --- doctor -----------------------------------------------------------------------------
    def doctor_checks(self) -> list[Check]:
        """Known traps of this backend's stack, as ``portrl.device.checks.Check`` lines (chosen backend only)."""
        return []

    def host_checks(self) -> list[Check]:
        """Traps this backend's installed packages set for every backend on the host (run for all backends)."""
        return []

    # --- peaks (portrl/device/peaks.py) -------------------------------------------------------
    device_models: ClassVar[tuple[DeviceModel, ...]] = ()  # the peak table: models, their datasheet peaks per dtype

    def device_name(self) -> str:
        """The current device's name as the vendor's runtime reports it ("" where it cannot tell)."""
        try:
            mod = self._module()
            return str(mod.get_device_name(mod.current_device()))
        except (AttributeError, RuntimeError, AssertionError):
            return ""

    def peak_throughput(self, dtype: str, model: str | None = None) -> PeakThroughput | None:
        """The peaks of device ``model`` (``device.model``; None: the model :meth:`device_name` names) in ``dtype``,
        None where none is declared; an unknown ``model`` is a UserError listing this backend's models."""
        found = named_model(self.device_models, model, self.name) if model else \
            model_of_name(self.device_models, self.device_name())
        return found.peaks.get(dtype) if found is not None else None

    # --- misc ---------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r}>"


#: what every backend answers itself, with no default in :class:`Backend` (a default would be one vendor's answer,
#: silently given to another): a backend class that lacks one is refused when it registers
#: (portrl.device.registry), and mypy refuses to instantiate it
REQUIRED_ANSWERS = ("supports_bf16", "fp8_dtype", "memory_stats", "reset_peak_memory", "memory_available")


def missing_answers(cls: type[Backend]) -> list[str]:
    """The :data:`REQUIRED_ANSWERS` that backend class ``cls`` does not give (inherits only Backend's)."""
    return [n for n in REQUIRED_ANSWERS if getattr(getattr(cls, n, None), "__isabstractmethod__", False)]


def torch_memory_stats(mod: ModuleType) -> dict[str, int]:
    """``memory_stats`` of a device whose torch module (``torch.<device>``) counts its allocator's bytes:
    ``allocated``, ``reserved``, ``peak_allocated`` on the current device."""
    return {
        "allocated": int(mod.memory_allocated()),
        "reserved": int(mod.memory_reserved()),
        "peak_allocated": int(mod.max_memory_allocated()),
    }


def torch_memory_available(mod: ModuleType) -> int | None:
    """``memory_available`` from a torch device module: its ``mem_get_info()`` free bytes on the current device,
    None where it has none or it fails."""
    info = getattr(mod, "mem_get_info", None)
    try:
        return int(info()[0]) if info is not None else None
    except RuntimeError:
        return None


def import_optional(module: str, install: str) -> ModuleType:
    """Import an optional package, or raise ImportError naming the package and its install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is required here but is not importable ({exc}); install it with: {install}") from exc
