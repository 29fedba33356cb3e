"""FLOPs and bytes of a step from a :class:`~portrl.plan.shape.ModelShape`: what MFU and the rooflines divide
(portrl/trainer/speed.py, docs/performance.md). ``L`` layers, ``h`` hidden, ``a`` heads, ``d`` head dimension,
``V`` vocabulary, ``s`` a sequence's length (prompt and response), ``T = sum(s)``.

**Update** (:func:`train_flops`), verl's convention (``verl/utils/flops_counter.py``, ``_estimate_qwen2_flops``,
which verl also uses for Llama and Qwen2.5-VL), so that ``perf/mfu/actor`` compares with verl's::

    N     = L * layer_matmul_params + 2 V h        (q, k, v, o and the MLP's three matrices; no biases, no norms)
    FLOPs = 6 N T + 12 sum(s^2) d a L

``2 V h`` counts the embedding and the LM head as two matmuls even when they are tied (verl does the same: the
embedding is a gather, so this overstates a tied model's work by ``6 V h T``), and attention is counted over the
full ``s x s`` square, not its causal half. What a run executes (:func:`executed_train_flops`): ``T`` counts a
prompt that rows share once where the packed forward runs it once, and under gradient checkpointing the layers'
forward runs again in backward, ``2 (N - 2 V h) T + 4 sum(s^2) d a L``.

**Rollout** (:func:`rollout_flops`), what runs: each position ``t`` of a sequence (1-based, the prompt's in the
prefill, then one per decode step; the last sampled token is never fed back, so ``s - 1`` positions) costs
``2 N_fwd + 4 L a d t``, with ``N_fwd = L * layer_matmul_params + V h`` (the head once, the embedding a gather)
and ``4 L a d t`` for ``q k^T`` and ``p v`` over its ``t`` keys: per sequence
``2 N_fwd (s - 1) + 2 L a d s (s - 1)``.

**Decode bytes** (:func:`rollout_read_bytes`), what a batched decode reads at least: the weights once per forward
(the prefill and ``max(r) - 1`` decode steps for responses of ``r`` tokens), every parameter but an untied input
embedding (only its rows are gathered; :func:`weight_read_bytes`), and each row's key/value cache at each of its
decode steps: ``sum_rows ((r - 1) p + r (r - 1) / 2) * kv_bytes_per_token``.
"""

from __future__ import annotations

from typing import Sequence

from portrl.plan.shape import ModelShape


def verl_dense_params(shape: ModelShape) -> int:
    """verl's ``dense_N``: the layers' matrices and ``2 V h`` for the embedding and the head, tied or not."""
    return shape.layers * shape.layer_matmul_params + 2 * shape.vocab * shape.hidden


def _attention_width(shape: ModelShape) -> int:
    """``d a L``: the factor of every attention-score FLOP count."""
    return shape.head_dim * shape.heads * shape.layers


def train_flops(shape: ModelShape, seqlens: Sequence[int]) -> float:
    """One update pass (forward and backward) over sequences of ``seqlens`` tokens, verl's count:
    ``6 N T + 12 sum(s^2) d a L`` (module docstring)."""
    tokens, squares = sum(seqlens), sum(s * s for s in seqlens)
    return 6.0 * verl_dense_params(shape) * tokens + 12.0 * squares * _attention_width(shape)


def executed_train_flops(shape: ModelShape, seqlens: Sequence[int], checkpointing: bool,
                         tokens: int | None = None) -> float:
    """:func:`train_flops` with ``T = tokens`` in its ``6 N T`` (the tokens the forward runs: fewer than
    ``sum(seqlens)`` where rows that share a prompt run it once; default ``sum(seqlens)``), plus, under gradient
    checkpointing, the layers' recomputed forward ``2 L layer_matmul_params T + 4 sum(s^2) d a L`` (the head and the
    embedding are not checkpointed)."""
    run = sum(seqlens) if tokens is None else tokens
    squares = sum(s * s for s in seqlens)
    flops = 6.0 * verl_dense_params(shape) * run + 12.0 * squares * _attention_width(shape)
    if checkpointing:
        flops += 2.0 * shape.layers * shape.layer_matmul_params * run + 4.0 * squares * _attention_width(shape)
    return flops


def forward_params(shape: ModelShape) -> int:
    """``N_fwd``: the matrices one token's forward multiplies, the layers' and the LM head's."""
    return shape.layers * shape.layer_matmul_params + shape.vocab * shape.hidden


def rollout_flops(shape: ModelShape, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> float:
    """Generating ``response_lens[i]`` tokens after prompts of ``prompt_lens[i]``: ``sum_rows 2 N_fwd (s - 1) +
    2 L a d s (s - 1)`` with ``s = p + r`` (module docstring)."""
    n, width = forward_params(shape), _attention_width(shape)
    total = 0.0
    for p, r in zip(prompt_lens, response_lens, strict=True):
        s = p + r
        total += 2.0 * n * (s - 1) + 2.0 * width * s * (s - 1)
    return total


def prefill_flops(shape: ModelShape, prompt_len: int) -> float:
    """A prompt's prefill alone, positions ``1..p``: ``2 N_fwd p + 2 L a d p (p + 1)``; an engine that prefills a
    prompt its ``n`` samples share once runs this ``n - 1`` times less than :func:`rollout_flops` counts."""
    p = prompt_len
    return 2.0 * forward_params(shape) * p + 2.0 * _attention_width(shape) * p * (p + 1)


def weight_read_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of weights one forward of the language model reads: every parameter (a tied table once, as the head)
    but an untied input embedding's and the vision tower's."""
    untied_embedding = 0 if shape.tied else shape.embed_params
    return (shape.params - shape.vision_params - untied_embedding) * dtype_bytes


def rollout_read_bytes(shape: ModelShape, prompt_lens: Sequence[int], response_lens: Sequence[int],
                       dtype_bytes: int, kv_dtype_bytes: int | None = None) -> tuple[int, int]:
    """``(weight bytes, key/value cache bytes)`` a batched generation reads at least: the weights
    ``1 + max(r) - 1`` times (the prefill and the decode steps), each row's cache ``(r - 1) p + r (r - 1) / 2``
    tokens' worth (``kv_dtype_bytes`` per element, default ``dtype_bytes``)."""
    steps = max(max(response_lens, default=0) - 1, 0)
    cached = sum((r - 1) * p + r * (r - 1) // 2 for p, r in zip(prompt_lens, response_lens, strict=True) if r > 0)
    kv = kv_dtype_bytes if kv_dtype_bytes is not None else dtype_bytes
    return (1 + steps) * weight_read_bytes(shape, dtype_bytes), cached * shape.kv_bytes_per_token * kv
