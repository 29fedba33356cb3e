"""Copy named tensors (HF parameter names) into an nn.Module, checking names, shapes and sharing."""

from __future__ import annotations

from typing import Iterable

import torch

# Wrappers whose prefixes a trainer's state_dict may carry (DDP, torch.compile, activation checkpointing).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        name = name.replace("._checkpoint_wrapped_module.", ".")
    return name


@torch.no_grad()
def load_named_tensors(module: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Copy each ``(name, tensor)`` into the parameter or buffer of ``module`` with that name.

    A tensor that already *is* the target's storage (a colocated engine sharing the trainer's
    module) is not copied. Returns ``{"copied": c, "shared": s}``. An unknown name or a shape
    mismatch is an error naming it; nothing is partially reported as success.
    """
    targets = {_strip(k): v for k, v in module.state_dict(keep_vars=True).items()}
    copied = shared = 0
    for name, tensor in named_tensors:
        key = _strip(name)
        target = targets.get(key)
        if target is None:
            sample = ", ".join(sorted(targets)[:5])
            raise KeyError(f"update_weights: the engine's model has no tensor {name!r} (names look like: {sample}, ...)")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine expects {tuple(target.shape)}"
            )
        if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device and target.dtype == tensor.dtype:
            shared += 1
            continue
        target.data.copy_(tensor.detach())
        copied += 1
    return {"copied": copied, "shared": shared}
