"""Weight updates in bounded pieces: :func:`bucket_named_tensors`, shared by the engines that take weights as
tensors."""

from __future__ import annotations

from typing import Any, Iterable


def bucket_named_tensors(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterable[list[tuple[str, Any]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (one oversized tensor is its own bucket)."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
