"""Batch: the container every worker method takes and returns.

A Batch of ``B`` rows holds tensors whose first dimension is ``B`` (``.tensors``) and per-row
Python lists of length ``B`` (``.meta``: uid, data_source, ground_truth, extra_info, ...), plus
``.info``, a dict of batch-level values (not split; copied to every piece).

Layout (verl's): ``prompts (B,P)`` left-padded, ``responses (B,T)`` right-padded,
``input_ids = cat(prompts, responses) (B,P+T)``, ``attention_mask (B,P+T)``,
``response_mask (B,T)`` (1 on response tokens incl. EOS).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import torch

Index = Union[Sequence[int], torch.Tensor]


class Batch:
    """Dict-like rows of tensors (first dim B) and per-row lists, with select/chunk/concat/union."""

    __slots__ = ("tensors", "meta", "info")

    def __init__(
        self,
        tensors: Optional[Mapping[str, torch.Tensor]] = None,
        meta: Optional[Mapping[str, Sequence[Any]]] = None,
        info: Optional[Mapping[str, Any]] = None,
    ):
        self.tensors: Dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: Dict[str, List[Any]] = {k: list(v) for k, v in (meta or {}).items()}
        self.info: Dict[str, Any] = dict(info or {})
        self._check()

    # ------------------------------------------------------------------ basic container protocol
    def _check(self) -> None:
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.meta.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch: every entry must have the same number of rows, got {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for column in self.meta.values():
            return len(column)
        return 0

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"Batch has no key {key!r}; it has tensors {sorted(self.tensors)} and meta {sorted(self.meta)}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Tensors go to ``.tensors``, sequences to ``.meta``; the row count must match the other entries."""
        store: dict[str, Any]
        other: dict[str, Any]
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"Batch[{key!r}]: a 0-d tensor has no rows; put batch-level values in .info")
            rows, store, other = int(value.shape[0]), self.tensors, self.meta
        else:
            value = list(value)
            rows, store, other = len(value), self.meta, self.tensors
        sizes = {int(v.shape[0]) for k, v in self.tensors.items() if k != key}
        sizes |= {len(v) for k, v in self.meta.items() if k != key}
        if sizes and rows not in sizes:
            raise ValueError(f"Batch[{key!r}] has {rows} rows, the batch has {sizes.pop()}")
        other.pop(key, None)
        store[key] = value

    def get(self, key: str, default: Any = None):
        return self[key] if key in self else default

    def keys(self) -> List[str]:
        return list(self.tensors) + list(self.meta)

    def pop(self, key: str, default: Any = KeyError):
        if key in self.tensors:
            return self.tensors.pop(key)
        if key in self.meta:
            return self.meta.pop(key)
        if default is KeyError:
            raise KeyError(key)
        return default

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"Batch(rows={len(self)}, tensors={shapes}, meta={sorted(self.meta)}, info={sorted(self.info)})"

    # ---------------------------------------------------------------------------- row operations
    def select(self, idx: Index) -> "Batch":
        """Rows ``idx`` (ints, an int tensor, or a bool mask of length B), in that order."""
        if isinstance(idx, torch.Tensor):
            if idx.dtype == torch.bool:
                if idx.numel() != len(self):
                    raise ValueError(f"Batch.select: bool mask has {idx.numel()} entries, batch has {len(self)} rows")
                idx = idx.nonzero(as_tuple=True)[0]
            rows = [int(i) for i in idx.tolist()]
        else:
            rows = [int(i) for i in idx]
        index = torch.tensor(rows, dtype=torch.long)
        tensors = {k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()}
        meta = {k: [v[i] for i in rows] for k, v in self.meta.items()}
        return Batch(tensors, meta, self.info)

    def slice(self, start: int, stop: int) -> "Batch":
        tensors = {k: v[start:stop] for k, v in self.tensors.items()}
        meta = {k: v[start:stop] for k, v in self.meta.items()}
        return Batch(tensors, meta, self.info)

    def chunk(self, k: int) -> List["Batch"]:
        """``k`` contiguous pieces whose sizes differ by at most one (the first ones larger)."""
        if k < 1:
            raise ValueError(f"Batch.chunk: k must be >= 1, got {k}")
        n = len(self)
        base, extra = divmod(n, k)
        out, start = [], 0
        for i in range(k):
            stop = start + base + (1 if i < extra else 0)
            out.append(self.slice(start, stop))
            start = stop
        return out

    def split(self, size: int) -> List["Batch"]:
        """Contiguous pieces of ``size`` rows (the last may be smaller)."""
        if size < 1:
            raise ValueError(f"Batch.split: size must be >= 1, got {size}")
        return [self.slice(s, min(s + size, len(self))) for s in range(0, len(self), size)]

    def repeat_interleave(self, n: int) -> "Batch":
        """Each row repeated ``n`` times in place (row i -> rows i*n .. i*n+n-1)."""
        return self.select([i for i in range(len(self)) for _ in range(n)])

    @staticmethod
    def concat(batches: Iterable["Batch"]) -> "Batch":
        """Rows of all batches in order; every batch must have the same keys and tensor widths
        (see :func:`pad_rollout` to bring rollouts of different lengths to one width first)."""
        batches = [b for b in batches]
        if not batches:
            return Batch()
        keys_t, keys_m = set(batches[0].tensors), set(batches[0].meta)
        for b in batches[1:]:
            if set(b.tensors) != keys_t or set(b.meta) != keys_m:
                raise ValueError(
                    f"Batch.concat: key mismatch {sorted(keys_t | keys_m)} vs {sorted(set(b.tensors) | set(b.meta))}"
                )
        tensors = {k: _cat([b.tensors[k] for b in batches], k) for k in batches[0].tensors}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        info: Dict[str, Any] = {}
        for b in batches:
            info.update(b.info)
        return Batch(tensors, meta, info)

    def union(self, other: "Batch") -> "Batch":
        """This batch with ``other``'s keys added (in place, returned). A shared key must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"Batch.union: row counts differ ({len(self)} vs {len(other)})")
        for k, v in other.tensors.items():
            if k in self.tensors and not (self.tensors[k].shape == v.shape and torch.equal(self.tensors[k], v)):
                raise ValueError(f"Batch.union: key {k!r} is in both batches with different values")
            self.tensors[k] = v
        for k, column in other.meta.items():
            if k in self.meta and self.meta[k] != column:
                raise ValueError(f"Batch.union: key {k!r} is in both batches with different values")
            self.meta[k] = list(column)
        self.info.update(other.info)
        return self

    def to(self, device: Union[str, torch.device]) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta, self.info)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


def _cat(ts: List[torch.Tensor], key: str) -> torch.Tensor:
    if len({t.shape[1:] for t in ts}) > 1:
        raise ValueError(
            f"Batch.concat: {key!r} has shapes {[tuple(t.shape) for t in ts]}; pad rollouts with pad_rollout first"
        )
    return torch.cat(ts, 0)


PROMPT_KEYS = ("prompts",)
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def pad_rollout(batch: Batch, prompt_len: int, response_len: int, pad_token_id: int = 0) -> Batch:
    """A rollout batch widened to ``prompt_len`` prompt and ``response_len`` response columns.

    Prompts are padded on the left, responses (and every other 2-d per-token tensor: masks, log-probs,
    rewards, ...) on the right; ``input_ids``/``attention_mask`` are split at the prompt width and
    each part padded on its side. Token tensors get ``pad_token_id``, everything else 0.
    """
    P = batch.tensors["prompts"].shape[1]
    T = batch.tensors["responses"].shape[1]
    if prompt_len < P or response_len < T:
        raise ValueError(f"pad_rollout: cannot shrink ({P},{T}) to ({prompt_len},{response_len})")
    if (P, T) == (prompt_len, response_len):
        return batch
    dp, dt = prompt_len - P, response_len - T
    F = torch.nn.functional
    out: Dict[str, torch.Tensor] = {}
    for k, v in batch.tensors.items():
        fill = pad_token_id if k in ("prompts", "responses", "input_ids") else 0
        if v.dim() < 2:
            out[k] = v
        elif k in PROMPT_KEYS:
            out[k] = F.pad(v, (dp, 0), value=fill)
        elif k in SEQUENCE_KEYS:
            out[k] = torch.cat([F.pad(v[:, :P], (dp, 0), value=fill), F.pad(v[:, P:], (0, dt), value=fill)], 1)
        else:
            out[k] = F.pad(v, (0, dt), value=fill)
    return Batch(out, batch.meta, batch.info)


def concat_rollouts(batches: Sequence[Batch], pad_token_id: int = 0) -> Batch:
    """Concatenate rollout batches of possibly different prompt/response widths (padded to the widest)."""
    P = max(b.tensors["prompts"].shape[1] for b in batches)
    T = max(b.tensors["responses"].shape[1] for b in batches)
    return Batch.concat([pad_rollout(b, P, T, pad_token_id) for b in batches])


def build_rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    logprobs: Optional[Sequence[Sequence[float]]] = None,
    *,
    pad_token_id: int = 0,
    n: int = 1,
    meta: Optional[Mapping[str, Sequence[Any]]] = None,
    response_masks: Optional[Sequence[Sequence[int]]] = None,
) -> Batch:
    """A rollout Batch from token lists: ``len(prompt_ids) * n`` rows, prompt-major (row ``i*n+j`` is
    sample ``j`` of prompt ``i``). Prompts are left-padded to the longest prompt, responses
    right-padded to the longest response; ``meta`` lists (one entry per prompt) are repeated ``n`` times.
    ``response_masks`` (multi-turn rollouts, one per response): 1 on the model's tokens, 0 on the tool and
    environment tokens between its turns; ``response_mask`` takes it, ``attention_mask`` stays 1 on every
    response token (the model reads the tool tokens). Default: 1 on every response token.

    Tensors: prompts, responses, input_ids, attention_mask, response_mask (and rollout_log_probs).
    """
    B = len(prompt_ids) * n
    if len(response_ids) != B:
        raise ValueError(f"build_rollout_batch: {len(prompt_ids)} prompts x n={n} needs {B} responses, "
                         f"got {len(response_ids)}")
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in response_ids))
    prompts = torch.full((len(prompt_ids), P), pad_token_id, dtype=torch.long)
    pmask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p):
            prompts[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            pmask[i, P - len(p):] = 1
    responses = torch.full((B, T), pad_token_id, dtype=torch.long)
    rmask = torch.zeros((B, T), dtype=torch.long)
    model_mask = torch.zeros((B, T), dtype=torch.long) if response_masks is not None else rmask
    lps = torch.zeros((B, T), dtype=torch.float32) if logprobs is not None else None
    for r, ids in enumerate(response_ids):
        k = len(ids)
        if k:
            responses[r, :k] = torch.as_tensor(list(ids), dtype=torch.long)
            rmask[r, :k] = 1
            if response_masks is not None:
                if len(response_masks[r]) != k:
                    raise ValueError(f"build_rollout_batch: row {r} has {k} response tokens but "
                                     f"{len(response_masks[r])} response-mask entries")
                model_mask[r, :k] = torch.as_tensor(list(response_masks[r]), dtype=torch.long)
            if lps is not None and logprobs is not None:
                lps[r, :k] = torch.as_tensor(list(logprobs[r]), dtype=torch.float32)
    prompts = prompts.repeat_interleave(n, 0)
    pmask = pmask.repeat_interleave(n, 0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([pmask, rmask], 1),
        "response_mask": model_mask,
    }
    if lps is not None:
        tensors["rollout_log_probs"] = lps
    rows = {k: [x for x in v for _ in range(n)] for k, v in (meta or {}).items()}
    for key, v in (meta or {}).items():
        if len(v) != len(prompt_ids):
            raise ValueError(f"build_rollout_batch: meta[{key!r}] has {len(v)} entries for {len(prompt_ids)} prompts")
    return Batch(tensors, rows)


def response_valid_mask(batch: Batch) -> torch.Tensor:
    """``(B,T)`` mask of a rollout's *valid* response tokens: every response token that is not padding, the
    model's tokens and, in a multi-turn rollout, the tool / environment tokens between its turns (the response
    part of ``attention_mask``, verl's ``compute_response_mask``). ``response_mask`` marks the model's tokens
    only (what is trained on); for a single-turn rollout the two are equal. A batch without ``attention_mask``
    falls back to ``response_mask``.

    Use it to decode a response (rewards, traces) and for its length against ``data.max_response_length``
    (overlong shaping, truncation); every loss, entropy, KL, advantage and value aggregation uses
    ``response_mask``."""
    T = batch.tensors["responses"].shape[1] if "responses" in batch else batch.tensors["response_mask"].shape[1]
    if "attention_mask" not in batch:
        return batch.tensors["response_mask"]
    mask = batch.tensors["attention_mask"]
    return mask[:, mask.shape[1] - T:]


def response_lengths(batch: Batch) -> torch.Tensor:
    """``(B,)`` int64: the number of valid response tokens of each row (:func:`response_valid_mask`)."""
    return (response_valid_mask(batch) != 0).sum(-1)
