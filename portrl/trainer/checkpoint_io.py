"""The checkpoint file format: tensors in safetensors, everything else in JSON; loading never unpickles.

``save_state(dir, name, state)`` writes a nested state (dicts with string keys, lists, tuples, tensors,
numpy arrays, numbers, strings, bools, None) as two files:

* ``<name>.safetensors``: every tensor, under its dotted path (``model.lm_head.weight``,
  ``optimizer.state.<param>.exp_avg``, ``rng.torch``); tensors sharing storage (tied weights) are stored
  once;
* ``<name>.json``: the tree itself, a tensor leaf replaced by ``{"__tensor__": key}``, a tuple by
  ``{"__tuple__": [...]}`` (``random.getstate()`` and optimizer ``betas`` need tuples back), a numpy array
  by ``{"__ndarray__": [...], "dtype": ...}`` (numpy's RNG key: 624 uint32 values).

``load_state(dir, name)`` reads them back with ``json`` and ``safetensors.torch.load_file``: a crafted
file can hold wrong numbers, never code. Tensors load on the CPU.

``FORMAT_VERSION`` is recorded in every manifest (``meta.format``); a checkpoint written before it
(``actor.pt`` / ``trainer.pt``, pickled) or by a newer format is refused with a message naming its version.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from portrl.user_files import ordinary_permissions

#: 1: safetensors + JSON (portrl 0.2.0). Before it: pickled ``*.pt`` files, no ``meta.format``.
FORMAT_VERSION = 1
LEGACY_FILES = ("actor.pt", "critic.pt", "trainer.pt")

_TENSOR, _TUPLE, _NDARRAY = "__tensor__", "__tuple__", "__ndarray__"


class StateFormatError(ValueError):
    """A state file pair that does not decode (a malformed tree, a missing tensor)."""


def _encode(obj: Any, path: str, tensors: Dict[str, torch.Tensor], seen: Dict[tuple, str]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "full_tensor"):  # a DTensor: the caller should have gathered it; be safe
            t = t.full_tensor()
        t = t.cpu()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in seen:  # the same tensor (a tied weight) under a second name
            return {_TENSOR: seen[ident]}
        key = path
        n = 1
        while key in tensors:
            n += 1
            key = f"{path}#{n}"
        storage = ("storage", t.untyped_storage().data_ptr())
        if t.numel() and (storage in seen or not t.is_contiguous()):
            t = t.contiguous().clone()  # safetensors refuses non-contiguous views and tensors sharing memory
        tensors[key] = t  # otherwise no copy: a big state is not held twice while it is written
        if t.numel():
            seen[ident] = key
            seen[("storage", t.untyped_storage().data_ptr())] = key
        return {_TENSOR: key}
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"state key {k!r} at {path or '<root>'} is not a string or int")
            out[str(k)] = _encode(v, f"{path}.{k}" if path else str(k), tensors, seen)
        if any(isinstance(k, int) for k in obj):  # optimizer state keyed by index: keep the int keys
            return {"__intkeys__": out}
        return out
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors, seen) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors, seen) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {path or '<root>'} in a checkpoint "
                    f"(tensors, numpy arrays, numbers, strings, lists, tuples and dicts only)")


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            key = obj[_TENSOR]
            if not isinstance(key, str) or key not in tensors:
                raise StateFormatError(f"tensor {key!r} is not in the safetensors file")
            return tensors[key]
        if _TUPLE in obj:
            return tuple(_decode(v, tensors) for v in obj[_TUPLE])
        if _NDARRAY in obj:
            return np.asarray(obj[_NDARRAY], dtype=np.dtype(str(obj.get("dtype", "float64"))))
        if "__intkeys__" in obj:
            return {(int(k) if k.lstrip("-").isdigit() else k): _decode(v, tensors)
                    for k, v in obj["__intkeys__"].items()}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_state(directory: str | os.PathLike, name: str, state: Mapping[str, Any]) -> list[Path]:
    """Write ``state`` as ``<name>.safetensors`` + ``<name>.json`` in ``directory``; returns the paths."""
    directory = Path(directory)
    tensors: Dict[str, torch.Tensor] = {}
    tree = _encode(dict(state), "", tensors, {})
    st, js = directory / f"{name}.safetensors", directory / f"{name}.json"
    save_file(tensors, str(st))
    ordinary_permissions(st)  # safetensors creates the file 0600; a checkpoint is an ordinary user file
    with open(js, "w") as fh:
        json.dump(tree, fh)
    return [st, js]


def load_state(directory: str | os.PathLike, name: str) -> Dict[str, Any]:
    """The state :func:`save_state` wrote (tensors on the CPU). Raises StateFormatError when it does not decode."""
    directory = Path(directory)
    st, js = directory / f"{name}.safetensors", directory / f"{name}.json"
    for p in (st, js):
        if not p.is_file():
            raise StateFormatError(f"{p.name} is missing")
    try:
        tree = json.loads(js.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise StateFormatError(f"{js.name} is not valid JSON ({type(exc).__name__}: {exc})") from None
    try:
        tensors = load_file(str(st))
    except (SafetensorError, OSError, ValueError) as exc:
        raise StateFormatError(f"{st.name} is not a valid safetensors file ({exc})") from None
    if not isinstance(tree, dict):
        raise StateFormatError(f"{js.name} does not hold a state dict")
    try:
        return _decode(tree, tensors)
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise StateFormatError(f"{js.name} does not decode ({type(exc).__name__}: {exc})") from None


__all__ = ["FORMAT_VERSION", "LEGACY_FILES", "StateFormatError", "save_state", "load_state"]
