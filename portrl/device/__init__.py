"""Device abstraction: the Backend contract and the registry of backends."""

from portrl.device.backend import Backend, ProbeResult, import_optional, module_available
from portrl.device.registry import (
    BackendError,
    all_backends,
    backend_names,
    broken_backends,
    check_cli_device,
    clear_cache,
    config_backend,
    detect,
    get_backend,
    resolve_backend,
    usable_names,
)
from portrl.device.versions import CompatRow, package_version

__all__ = [
    "Backend", "BackendError", "CompatRow", "ProbeResult", "all_backends", "backend_names", "broken_backends",
    "check_cli_device", "clear_cache", "config_backend", "detect", "get_backend", "import_optional", "module_available",
    "package_version", "resolve_backend", "usable_names",
]
