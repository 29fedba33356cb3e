"""Registry of op implementations: which function serves each op, and which one runs here.

Every op has a pure-torch ``native`` implementation (``portrl.ops``). A backend adds faster ones
from its ``register_kernels(registry)`` (this module is the ``registry`` it receives), and its
``kernel_preferences()`` gives, per op, the implementation names best first. :func:`select`
walks that order, appends ``native`` and returns the first implementation that can run here.
The choice is logged once per (backend, op, implementation). Asking by name for an
implementation that is unknown or cannot run here is an :class:`OpError` that lists those that can.

``available`` (given at registration) is a zero-argument callable answering "can this run
here?": ``True`` means yes; ``False`` or a non-empty string (the reason) means no.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from portrl.device import get_backend, resolve_backend
from portrl.device.backend import Backend
from portrl.ops.attention import attention_varlen, decode_attention
from portrl.ops.decode_layer import decode_layer
from portrl.ops.layers import apply_rotary, linear_prepacked, rms_norm, swiglu
from portrl.ops.logprobs import logprobs_entropy
from portrl.ops.logprobs_vocab import logprobs_entropy_vocab_blocks
from portrl.ops.rotary_multimodal import apply_multimodal_rotary

log = logging.getLogger(__name__)

#: the ops every backend may serve; each has a native implementation in portrl.ops
OPS = ("attention_varlen", "decode_attention", "decode_layer", "linear_prepacked", "logprobs_entropy", "rms_norm", "rotary",
       "rotary_multimodal", "swiglu")
NATIVE = "native"


class OpError(ValueError):
    """An op or implementation name is unknown, or the implementation cannot run here."""


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    fn: Callable
    available: Callable[[], bool | str] | None = None

    def why_not(self) -> str | None:
        """None when this implementation can run here, else the reason it cannot."""
        if self.available is None:
            return None
        try:
            ok = self.available()
        except Exception as exc:  # an availability probe must never crash selection
            return f"availability check failed: {exc}"
        if ok is True:
            return None
        return ok if isinstance(ok, str) and ok else "not available here"


_lock = threading.Lock()
_impls: dict[str, dict[str, Impl]] = {op: {} for op in OPS}
_backends_loaded: set[str] = set()
_logged: set[tuple[str, str, str]] = set()


def _check_op(op: str) -> None:
    if op not in OPS:
        raise OpError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")


def register(op: str, impl: str, fn: Callable, available: Callable[[], bool | str] | None = None) -> None:
    """Register ``fn`` as implementation ``impl`` of ``op``. Registering a name again replaces it."""
    _check_op(op)
    if not impl or not isinstance(impl, str):
        raise OpError(f"implementation name for op {op!r} must be a non-empty string, got {impl!r}")
    if not callable(fn):
        raise OpError(f"implementation {impl!r} of op {op!r} is not callable: {fn!r}")
    with _lock:
        _impls[op][impl] = Impl(op, impl, fn, available)


def unregister(op: str, impl: str) -> None:
    """Remove an implementation (tests); ``native`` cannot be removed."""
    _check_op(op)
    if impl == NATIVE:
        raise OpError("the native implementation cannot be unregistered")
    with _lock:
        _impls[op].pop(impl, None)


# the pure-torch implementation of every op, always available
for _op, _fn in (("attention_varlen", attention_varlen), ("decode_attention", decode_attention),
                 ("decode_layer", decode_layer),
                 ("linear_prepacked", linear_prepacked),
                 ("logprobs_entropy", logprobs_entropy), ("rms_norm", rms_norm), ("rotary", apply_rotary),
                 ("rotary_multimodal", apply_multimodal_rotary), ("swiglu", swiglu)):
    register(_op, NATIVE, _fn)
del _op, _fn
# pure torch too, for any backend whose preferences name it: the log-prob op in vocabulary blocks
register("logprobs_entropy", "vocab_blocks", logprobs_entropy_vocab_blocks)


def _resolve_backend(backend: Backend | str | None) -> Backend:
    """A Backend instance, a registered name, or None (resolve the current backend)."""
    if backend is None:
        return resolve_backend()
    if isinstance(backend, str):
        return get_backend(backend)
    return backend


def load_backend_kernels(backend: Backend) -> None:
    """Call ``backend.register_kernels`` once per backend name (it registers into this module)."""
    name = backend.name
    with _lock:
        if name in _backends_loaded:
            return
        _backends_loaded.add(name)
    backend.register_kernels(sys.modules[__name__])


def implementations(op: str) -> dict[str, str | None]:
    """Registered implementations of ``op``: name -> None when it can run here, else the reason it cannot."""
    _check_op(op)
    return {name: impl.why_not() for name, impl in sorted(_impls[op].items())}


def runnable(op: str) -> list[str]:
    """Names of the implementations of ``op`` that can run here."""
    return [name for name, why in implementations(op).items() if why is None]


#: this process's choices by op (``device.kernels`` of the run: :func:`choose`), taken before a backend's order
_chosen: dict[str, str] = {}


def choose(kernels: dict) -> None:
    """Make ``kernels`` (op -> implementation name, the run's ``device.kernels``) this process's first choice for
    those ops: where its caller names no implementation, :func:`select` takes it when it can run here, else
    warns once and goes on down the backend's order (a preset's choice must not stop a machine without that
    kernel's package). Replaces earlier choices."""
    for op in kernels:
        _check_op(op)
    with _lock:
        _chosen.clear()
        _chosen.update({str(op): str(name) for op, name in kernels.items()})


def select(op: str, impl: str | None = None, backend: Backend | str | None = None) -> tuple[str, Callable]:
    """Choose the implementation of ``op``: ``impl`` if given, else this process's choice (:func:`choose`) when it
    can run here, else the backend's preference order then native.

    ``backend`` is a Backend, a backend name, or None for the resolved current backend; its kernels
    are registered on first use. Returns ``(impl_name, fn)``.
    """
    _check_op(op)
    be = _resolve_backend(backend)
    load_backend_kernels(be)
    table = _impls[op]
    if impl is not None and impl != "auto":
        found = table.get(impl)
        why = "not registered" if found is None else found.why_not()
        if why is not None:
            can = ", ".join(runnable(op))
            raise OpError(f"implementation {impl!r} of op {op!r} cannot run here ({why}); "
                          f"implementations that can: {can}")
        chosen = impl
    else:
        first = _chosen.get(op)
        order = ((first,) if first else ()) + tuple(be.kernel_preferences().get(op, ())) + (NATIVE,)
        chosen = next(name for name in order if name in table and table[name].why_not() is None)
        if first and chosen != first and (be.name, op, first) not in _logged:
            _logged.add((be.name, op, first))
            why = "not registered" if first not in table else table[first].why_not()
            log.warning("device.kernels.%s=%s cannot run here (%s); using %s", op, first, why, chosen)
    key = (be.name, op, chosen)
    if key not in _logged:
        _logged.add(key)
        log.info("op %s -> %s (backend %s)", op, chosen, be.name)
    return chosen, table[chosen].fn
