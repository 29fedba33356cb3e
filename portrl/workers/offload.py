"""Memory levers of a trained model: what waits in host memory between the calls that use it.

A worker names the parts of its state that rest on the host (``actor.offload``, ``critic.offload``,
``ref.param_offload``; verl's ``fsdp_config.param_offload``, ``optimizer_offload`` and ``enable_activation_offload``
are aliases) and marks each of its methods with the parts it reads (:func:`holding`). A marked call brings them to
the device, runs, and sends them back (verl's ``load_fsdp_model_to_gpu`` / ``offload_fsdp_model_to_cpu`` around
each worker call). The parts:

* ``params``: the float32 weights the optimizer steps. Under FSDP2 the module's own shards (the colocated engine
  decodes a full copy of its own, so generation does not need them); on one device or under DDP the separate
  float32 masters of a 16-bit run (portrl.workers.master_weights; the compute copy stays, since the engine and
  the log-prob passes read it). A float32 run without FSDP has no such part: its module is the engine's.
* ``optimizer``: AdamW's moments (and step counts), read only by the optimizer step and the checkpoint.
* ``reference``: the frozen reference policy, read only by its log-prob pass.

A method that reads the module's weights (a log-prob pass, a weight sync, an export) holds ``module``: the
``params`` part where those are FSDP2's shards, nothing where the module holds its compute copy itself.

Activation offload is not state: :func:`saved_on_host` keeps a training forward's saved tensors (not the
weights) in host memory until backward needs them (pinned memory on an accelerator).

Moving a tensor is exact, so a run with any lever on computes what it computes without (tests/test_offload.py);
what it lowers is each phase's peak on an accelerator (``portrl plan`` prints which). On the CPU the host is the
device: the moves are no-ops, and the bookkeeping still runs, so tests check that every call finds its parts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, TypeVar

import torch

HOST = torch.device("cpu")
PARTS = ("params", "optimizer", "reference")
F = TypeVar("F", bound=Callable[..., Any])


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every tensor of ``optimizer``'s per-parameter state to ``device`` (the moments; the step count too, which
    a fused or capturable AdamW keeps on the parameters' device)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = value.to(device)


def move_module(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to(device)``: under FSDP2 its sharded parameters move (as verl's ``offload_fsdp2_model_to_cpu``)."""
    module.to(device)


def move_tensors(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """Each tensor's storage (and its gradient's) to ``device``, the tensor objects kept (an optimizer holds them)."""
    with torch.no_grad():
        for t in tensors:
            t.data = t.data.to(device)
            if t.grad is not None:
                t.grad = t.grad.to(device)


class StateOffload:
    """Parts of a worker's state resting on the host, each with its mover (``part -> move(device)``).

    ``movers`` holds only the parts the config offloads (:meth:`add` registers one later); :meth:`on_device` of
    any other part does nothing. A registered part goes to the host at once. Calls nest: a part goes back to the
    host when the outermost call that brought it exits."""

    def __init__(self, device: torch.device, movers: Optional[Dict[str, Callable[[torch.device], None]]] = None,
                 module_is_params: bool = False):
        self.device, self.module_is_params = device, module_is_params
        self.movers: Dict[str, Callable[[torch.device], None]] = {}
        self._users: Dict[str, int] = {}
        for part, move in (movers or {}).items():
            self.add(part, move)

    def add(self, part: str, move: Callable[[torch.device], None]) -> None:
        """Offload ``part`` from now on (``move(device)`` puts it on ``device``); it goes to the host now."""
        if part not in PARTS:
            raise ValueError(f"StateOffload: unknown part {part!r}; parts are {', '.join(PARTS)}")
        self.movers[part], self._users[part] = move, 0
        move(HOST)

    def settle(self, part: str) -> None:
        """Send ``part`` back to the host unless a call is using it (after something rebuilt it on the device)."""
        if part in self.movers and self._users[part] == 0:
            self.movers[part](HOST)

    def resident(self, part: str) -> bool:
        """Whether ``part`` is on the device now (a part not offloaded always is)."""
        return part not in self.movers or self._users[part] > 0

    @contextlib.contextmanager
    def on_device(self, *parts: str) -> Iterator[None]:
        """``parts`` on the device for the block, back on the host after it (the offloaded ones; ``module``: see
        the module docstring)."""
        named = {"params" if p == "module" and self.module_is_params else p for p in parts}
        mine = [p for p in PARTS if p in named and p in self.movers]
        for part in mine:
            if self._users[part] == 0:
                self.movers[part](self.device)
            self._users[part] += 1
        try:
            yield
        finally:
            for part in mine:
                self._users[part] -= 1
                if self._users[part] == 0:
                    self.movers[part](HOST)


def holding(*parts: str) -> Callable[[F], F]:
    """A worker method that reads ``parts``: they are on the device while it runs (``self.offload``)."""

    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.offload.on_device(*parts):
                return fn(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return mark


def saved_on_host(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """The tensors a forward saves for backward kept in host memory until backward unpacks them (pinned on an
    accelerator); a no-op context when not ``enabled``.

    Parameters are saved as they are: a linear layer saves its weight, which the model holds anyway (and FSDP2
    gathers again for backward), so copying it out would only cost time (``torch.autograd.graph.save_on_cpu``
    copies every saved tensor, weights included). The copies are synchronous: overlapping them with compute, as
    verl's asynchronous activation offload does, is not done here."""
    if not enabled:
        return contextlib.nullcontext()
    pin = device.type != "cpu"

    def pack(t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):  # a weight, or its view
            return t
        host = torch.empty_like(t, device=HOST, pin_memory=pin)
        host.copy_(t)
        return t.device, host

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        where, host = packed
        return host.to(where)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
