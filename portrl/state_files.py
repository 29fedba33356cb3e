"""Nested states (a worker's model, optimizer, scheduler, RNG) as safetensors + JSON files; loading never unpickles.

``save_state(dir, name, state)`` writes a nested state (dicts with string keys, lists, tuples, tensors,
numpy arrays, numbers, strings, bools, None) as two files:

* ``<name>.safetensors``: every tensor, under its dotted path (``model.lm_head.weight``,
  ``optimizer.state.<param>.exp_avg``, ``rng.torch``); tensors sharing storage (tied weights) are stored
  once;
* ``<name>.json``: the tree itself, a tensor leaf replaced by ``{"__tensor__": key}``, a tuple by
  ``{"__tuple__": [...]}`` (``random.getstate()`` and optimizer ``betas`` need tuples back), a numpy array
  by ``{"__ndarray__": [...], "dtype": ...}`` (numpy's RNG key: 624 uint32 values).

``load_state(dir, name)`` reads them back with ``json`` and ``safetensors``: a crafted file can hold wrong
numbers, never code. Tensors load on the CPU.

Sharded states (FSDP2: parameters and optimizer moments are DTensors sharded over the ranks of a 1-D mesh):
``save_shard(dir, name, state, rank, world_size)`` writes rank ``rank``'s part alone, with no collective and
nothing gathered, as ``<name>/rank_<rank>.safetensors`` + ``<name>/rank_<rank>.json``. A sharded tensor's leaf
records where its local rows sit in the whole tensor (``{"__tensor__": key, "__shard__": {"dim", "offset",
"shape"}}``, torch.chunk's layout, which FSDP2 and DTensor use); every other leaf is the rank's own value (its
RNG, the scheduler, Adam's step count). :class:`ShardedState` reads such a folder back: the whole state
(every shard joined, for one worker or an export) or the rows one rank of any number of ranks owns, each read
from the files that hold them (safetensors slices: a rank never loads another rank's whole file).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from portrl.user_files import ordinary_permissions

_TENSOR, _TUPLE, _NDARRAY, _INTKEYS, _SHARD = "__tensor__", "__tuple__", "__ndarray__", "__intkeys__", "__shard__"
_SHARDS = "__shards__"  # a rank file's header: {"rank", "world_size"}

#: ``wrap(local, global_shape, dim)``: what a loaded shard becomes (a DTensor on the loading rank's mesh)
ShardWrap = Callable[[torch.Tensor, Tuple[int, ...], int], Any]


class StateFormatError(ValueError):
    """A state file pair that does not decode (a malformed tree, a missing tensor, shards that do not fit)."""


def shard_rows(size: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s rows when ``size`` rows are cut as ``torch.chunk`` cuts them (FSDP2's
    and DTensor's ``Shard`` layout: chunks of ``ceil(size / world_size)``, the last ones short or empty)."""
    chunk = math.ceil(size / world_size) if size else 0
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def _local_shard(t: Any) -> Tuple[torch.Tensor, Optional[dict]]:
    """A DTensor's local tensor and where it sits in the whole (None: replicated, the local tensor is all of it)."""
    mesh, placements = t.device_mesh, tuple(t.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not (placements[0].is_shard() or placements[0].is_replicate()):
        raise TypeError(f"cannot store a DTensor placed {placements} on a {mesh.ndim}-D mesh by shard (one Shard or "
                        f"Replicate placement on a 1-D mesh only)")
    local = t.to_local()
    if placements[0].is_replicate():
        return local, None
    dim = placements[0].dim % t.ndim
    shape = tuple(int(s) for s in t.shape)
    start, stop = shard_rows(shape[dim], mesh.size(), mesh.get_local_rank())
    if local.shape[dim] != stop - start:
        raise TypeError(f"a DTensor shard of {local.shape[dim]} rows along dim {dim} is not torch.chunk's "
                        f"{stop - start} of {shape[dim]} for rank {mesh.get_local_rank()} of {mesh.size()}")
    return local, {"dim": dim, "offset": start, "rows": stop - start, "shape": list(shape)}


class _Encoder:
    """One state's tree and tensors; ``sharded``: DTensors stay local shards (else each is gathered whole)."""

    def __init__(self, sharded: bool = False):
        self.sharded = sharded
        self.tensors: Dict[str, torch.Tensor] = {}
        self.seen: Dict[tuple, str] = {}

    def tensor(self, obj: torch.Tensor, path: str) -> dict:
        t, shard = obj.detach(), None
        if hasattr(t, "full_tensor"):  # a DTensor
            if self.sharded:
                t, shard = _local_shard(t)
            else:  # the caller should have gathered it; be safe
                t = t.full_tensor()
        t = t.cpu()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and ident in self.seen:  # the same tensor (a tied weight) under a second name
            leaf: dict[str, Any] = {_TENSOR: self.seen[ident]}
        else:
            key, n = path, 1
            while key in self.tensors:
                n += 1
                key = f"{path}#{n}"
            storage = ("storage", t.untyped_storage().data_ptr())
            if t.numel() and (storage in self.seen or not t.is_contiguous()):
                t = t.contiguous().clone()  # safetensors refuses non-contiguous views and tensors sharing memory
            self.tensors[key] = t  # otherwise no copy: a big state is not held twice while it is written
            if t.numel():
                self.seen[ident] = key
                self.seen[("storage", t.untyped_storage().data_ptr())] = key
            leaf = {_TENSOR: key}
        if shard is not None:
            leaf[_SHARD] = shard
        return leaf

    def encode(self, obj: Any, path: str = "") -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, np.ndarray):
            return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, (str, int)):
                    raise TypeError(f"state key {k!r} at {path or '<root>'} is not a string or int")
                out[str(k)] = self.encode(v, f"{path}.{k}" if path else str(k))
            if any(isinstance(k, int) for k in obj):  # optimizer state keyed by index: keep the int keys
                return {_INTKEYS: out}
            return out
        if isinstance(obj, tuple):
            return {_TUPLE: [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot store {type(obj).__name__} at {path or '<root>'} in a checkpoint "
                        f"(tensors, numpy arrays, numbers, strings, lists, tuples and dicts only)")


def _decode(obj: Any, tensor: Callable[[dict, tuple], Any], path: tuple = ()) -> Any:
    """The state of an encoded tree; ``tensor(leaf, path)`` gives a tensor leaf's value (``path``: the keys and
    indices down to it, the same in every rank's tree)."""
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensor(obj, path)
        if _TUPLE in obj:
            return tuple(_decode(v, tensor, path + (i,)) for i, v in enumerate(obj[_TUPLE]))
        if _NDARRAY in obj:
            return np.asarray(obj[_NDARRAY], dtype=np.dtype(str(obj.get("dtype", "float64"))))
        if _INTKEYS in obj:
            return {(int(k) if k.lstrip("-").isdigit() else k): _decode(v, tensor, path + (k,))
                    for k, v in obj[_INTKEYS].items()}
        return {k: _decode(v, tensor, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensor, path + (i,)) for i, v in enumerate(obj)]
    return obj


def _leaves(obj: Any, path: tuple = ()) -> Dict[tuple, dict]:
    """Every tensor leaf of an encoded tree by its path (the paths :func:`_decode` passes)."""
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return {path: obj}
        if _TUPLE in obj:
            items: Iterable[tuple[Any, Any]] = enumerate(obj[_TUPLE])
        elif _NDARRAY in obj:
            return {}
        else:
            items = (obj[_INTKEYS] if _INTKEYS in obj else obj).items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return {}
    out: Dict[tuple, dict] = {}
    for k, v in items:
        out.update(_leaves(v, path + (k,)))
    return out


def _write(directory: Path, stem: str, tensors: Dict[str, torch.Tensor], tree: Any) -> List[Path]:
    st, js = directory / f"{stem}.safetensors", directory / f"{stem}.json"
    save_file(tensors, str(st))
    ordinary_permissions(st)  # safetensors creates the file 0600; a checkpoint is an ordinary user file
    with open(js, "w") as fh:
        json.dump(tree, fh)
    return [st, js]


def _read_tree(js: Path) -> Any:
    if not js.is_file():
        raise StateFormatError(f"{js.name} is missing")
    try:
        return json.loads(js.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise StateFormatError(f"{js.name} is not valid JSON ({type(exc).__name__}: {exc})") from None


def _decoded(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except StateFormatError:
        raise
    except (TypeError, ValueError, AttributeError, RecursionError, KeyError, IndexError) as exc:
        raise StateFormatError(f"{name} does not decode ({type(exc).__name__}: {exc})") from None


def save_state(directory: str | os.PathLike, name: str, state: Mapping[str, Any]) -> List[Path]:
    """Write ``state`` as ``<name>.safetensors`` + ``<name>.json`` in ``directory``; returns the paths. A DTensor
    is gathered whole (every rank must then call it); :func:`save_shard` writes one rank's shards instead."""
    enc = _Encoder()
    tree = enc.encode(dict(state))
    return _write(Path(directory), name, enc.tensors, tree)


def load_state(directory: str | os.PathLike, name: str) -> Dict[str, Any]:
    """The state :func:`save_state` wrote (tensors on the CPU). Raises StateFormatError when it does not decode."""
    directory = Path(directory)
    st, js = directory / f"{name}.safetensors", directory / f"{name}.json"
    if not st.is_file():
        raise StateFormatError(f"{st.name} is missing")
    tree = _read_tree(js)
    try:
        tensors = load_file(str(st))
    except (SafetensorError, OSError, ValueError) as exc:
        raise StateFormatError(f"{st.name} is not a valid safetensors file ({exc})") from None
    if not isinstance(tree, dict):
        raise StateFormatError(f"{js.name} does not hold a state dict")

    def tensor(leaf: dict, _path: tuple) -> torch.Tensor:
        key = leaf[_TENSOR]
        if not isinstance(key, str) or key not in tensors:
            raise StateFormatError(f"tensor {key!r} is not in {st.name}")
        return tensors[key]

    return _decoded(js.name, lambda: _decode(tree, tensor))


def save_shard(directory: str | os.PathLike, name: str, state: Mapping[str, Any], rank: int,
               world_size: int) -> List[Path]:
    """Write rank ``rank``'s part of a sharded ``state`` as ``<name>/rank_<rank>.safetensors`` + ``.json`` in
    ``directory`` (the folder is made when missing): DTensors as their local shards (nothing gathered, no
    collective), everything else as this rank holds it."""
    folder = Path(directory) / name
    folder.mkdir(parents=True, exist_ok=True)
    enc = _Encoder(sharded=True)
    tree = enc.encode(dict(state))
    return _write(folder, f"rank_{int(rank)}", enc.tensors,
                  {_SHARDS: {"rank": int(rank), "world_size": int(world_size)}, "tree": tree})


def merge_state(state: Dict[str, Any], extra: Mapping[str, Any]) -> Dict[str, Any]:
    """``state`` with ``extra``'s entries put in place (nested dicts merged key by key, anything else replaced);
    ``state`` is changed and returned."""
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(state.get(k), dict):
            merge_state(state[k], v)
        else:
            state[k] = v
    return state


def is_sharded(directory: str | os.PathLike, name: str) -> bool:
    """Whether ``directory`` holds ``name`` as shards (a ``<name>/`` folder) rather than one file pair."""
    return (Path(directory) / name).is_dir()


class ShardedState:
    """The shards :func:`save_shard` wrote to ``<directory>/<name>/`` by every rank of one run. Opening checks
    that they are one complete set (ranks 0..N-1, each saying N, the same tensors of the same shapes); a set
    that is not is a StateFormatError naming the file."""

    def __init__(self, directory: str | os.PathLike, name: str):
        self.folder = Path(directory) / name
        self.name = name
        _decoded(f"{name}/", self._open)

    def _open(self) -> None:
        first = self._header(0)
        self.world_size = int(first[0]["world_size"])
        self.trees = [first[1]] + [self._header(r)[1] for r in range(1, self.world_size)]
        extra = sorted(p.name for p in self.folder.iterdir()
                       if p.suffix in (".json", ".safetensors") and not self._known(p.stem))
        if extra:
            raise StateFormatError(f"{self.name}/{extra[0]} is not one of the {self.world_size} shards its rank "
                                   f"files name")
        self.leaves = [_leaves(t) for t in self.trees]
        for r, leaves in enumerate(self.leaves[1:], start=1):
            if leaves.keys() != self.leaves[0].keys():
                raise StateFormatError(f"{self.name}/rank_{r}.json holds other tensors than {self.name}/rank_0.json")
            for path, leaf in leaves.items():
                if (leaf.get(_SHARD) or {}).get("shape") != (self.leaves[0][path].get(_SHARD) or {}).get("shape"):
                    raise StateFormatError(f"{self.name}/rank_{r}.json: {'.'.join(map(str, path))} has another shape "
                                           f"than in {self.name}/rank_0.json")

    def _known(self, stem: str) -> bool:
        return stem.startswith("rank_") and stem[5:].isdigit() and int(stem[5:]) < self.world_size

    def _header(self, rank: int) -> Tuple[dict, Any]:
        js = self.folder / f"rank_{rank}.json"
        doc = _read_tree(js)
        head = doc.get(_SHARDS) if isinstance(doc, dict) else None
        if not isinstance(head, dict) or not isinstance(doc.get("tree"), dict):
            raise StateFormatError(f"{self.name}/{js.name} is not a rank's shard file")
        size = head.get("world_size")
        if head.get("rank") != rank or not isinstance(size, int) or size < 1 or (rank and size != self.world_size):
            raise StateFormatError(f"{self.name}/{js.name} says rank {head.get('rank')!r} of {size!r}")
        if not (self.folder / f"rank_{rank}.safetensors").is_file():
            raise StateFormatError(f"{self.name}/rank_{rank}.safetensors is missing")
        return head, doc["tree"]

    def load(self, rank: Optional[int] = None, world_size: Optional[int] = None,
             wrap: Optional[ShardWrap] = None, tensors: bool = True) -> Dict[str, Any]:
        """The state. ``rank=None``: every sharded tensor whole (joined from all shards), the other leaves as
        rank 0 saved them. ``rank`` of ``world_size``: of each sharded tensor the rows that rank owns in
        torch.chunk's layout over ``world_size`` ranks, passed through ``wrap(local, shape, dim)`` when given;
        the other leaves as that rank saved them (rank 0's when the checkpoint had fewer ranks).
        ``tensors=False``: every tensor leaf None, nothing read but the JSON (a schedule's numbers)."""
        src = rank if rank is not None and rank < self.world_size else 0
        if not tensors:
            return _decoded(f"{self.name}/rank_{src}.json", lambda: _decode(self.trees[src], lambda *_: None))
        files: Dict[int, Any] = {}

        def open_rank(r: int):
            if r not in files:
                path = self.folder / f"rank_{r}.safetensors"
                try:
                    files[r] = safe_open(str(path), framework="pt")
                except (SafetensorError, OSError, ValueError) as exc:
                    raise StateFormatError(f"{self.name}/{path.name} is not a valid safetensors file ({exc})") from None
            return files[r]

        def read(r: int, leaf: dict, index: Optional[tuple] = None) -> torch.Tensor:
            key = leaf[_TENSOR]
            f = open_rank(r)
            if not isinstance(key, str) or key not in f.keys():
                raise StateFormatError(f"tensor {key!r} is not in {self.name}/rank_{r}.safetensors")
            return f.get_tensor(key) if index is None else f.get_slice(key)[index]

        def tensor(leaf: dict, path: tuple):
            shard = leaf.get(_SHARD)
            if shard is None:
                return read(src, leaf)
            dim, shape = int(shard["dim"]), tuple(int(s) for s in shard["shape"])
            if rank is not None and world_size is None:
                raise ValueError("StateFiles.load: a rank needs its world_size")
            start, stop = ((0, shape[dim]) if rank is None or world_size is None
                           else shard_rows(shape[dim], int(world_size), rank))
            parts, at = [], start
            for r in range(self.world_size):  # the saved shards lie in rank order along dim
                piece = self.leaves[r][path][_SHARD]
                lo = int(piece["offset"])
                a, b = max(at, lo), min(stop, lo + int(piece["rows"]))
                if a < b and a == at:
                    parts.append(read(r, self.leaves[r][path], (slice(None),) * dim + (slice(a - lo, b - lo),)))
                    at = b
            if at != stop:
                raise StateFormatError(f"rows {at}..{stop} of {'.'.join(map(str, path))} are in no shard of "
                                       f"{self.name}/")
            if not parts:  # this rank owns no rows of it (a short tensor over many ranks)
                parts = [read(src, leaf, (slice(None),) * dim + (slice(0, 0),))]
            local = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
            if tuple(local.shape[:dim]) + tuple(local.shape[dim + 1:]) != shape[:dim] + shape[dim + 1:]:
                raise StateFormatError(f"{'.'.join(map(str, path))}: a shard of shape {tuple(local.shape)} does not "
                                       f"fit the whole {shape}")
            return local if wrap is None or rank is None else wrap(local.contiguous(), shape, dim)

        try:
            return _decoded(f"{self.name}/rank_{src}.json", lambda: _decode(self.trees[src], tensor))
        finally:
            files.clear()


__all__ = ["ShardWrap", "ShardedState", "StateFormatError", "is_sharded", "load_state", "merge_state", "save_shard",
           "save_state", "shard_rows"]
