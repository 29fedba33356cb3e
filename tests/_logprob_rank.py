"""Test helper: compare two engines' greedy generations by rank at the first differing token.

This is the convention of a widely used serving engine's own model tests; tests/test_parity_vllm_rank.py uses
it to compare the HF and vLLM engines (it lived in portrl/parity/ until only tests called it).

Two engines decoding the same prompt greedily agree until rounding makes two near-tied tokens swap;
after that the texts diverge and comparing further says nothing. So, per sequence: find the first
position where the tokens differ; there, each side's token must be among the other side's top-k
candidates (``top_logprobs``). Identical sequences pass. Before the divergence, the largest gap
between the two sides' log-probs of the shared tokens is reported (not judged).

A sample is ``(token_ids: list[int], top_logprobs: list[dict[int, float]])``: one dict per
generated position mapping the top-k token ids to their log-probs.
"""

from __future__ import annotations

from typing import Any, Sequence

Sample = tuple[Sequence[int], Sequence[dict[int, float]]]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts at the shorter length);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _check_one(a: Sample, b: Sample, names: tuple[str, str]) -> dict[str, Any]:
    (ta, la), (tb, lb) = a, b
    for who, toks, lps in ((names[0], ta, la), (names[1], tb, lb)):
        if len(lps) < len(toks):
            raise ValueError(f"{who}: {len(toks)} tokens but only {len(lps)} top_logprobs entries")
    pos = first_divergence(ta, tb)
    shared = len(ta) if pos is None else pos
    gaps = [abs(la[i][ta[i]] - lb[i][tb[i]]) for i in range(shared) if ta[i] in la[i] and tb[i] in lb[i]]
    out: dict[str, Any] = {"first_diff": pos, "max_shared_logprob_gap": max(gaps, default=0.0)}
    if pos is None:
        return {**out, "ok": True, "reason": "identical"}
    if pos >= len(ta) or pos >= len(tb):
        short = names[0] if len(ta) < len(tb) else names[1]
        return {**out, "ok": False, "reason": f"{short} stopped at {pos} while the other continued"}
    in_b, in_a = ta[pos] in lb[pos], tb[pos] in la[pos]
    ok = in_a and in_b
    reason = "tokens swap within each other's top-k" if ok else (
        f"{names[0]} token {ta[pos]} {'in' if in_b else 'not in'} {names[1]} top-k {sorted(lb[pos])}; "
        f"{names[1]} token {tb[pos]} {'in' if in_a else 'not in'} {names[0]} top-k {sorted(la[pos])}")
    return {**out, "ok": ok, "reason": reason}


def rank_check(samples_a: Sequence[Sample], samples_b: Sequence[Sample],
               names: tuple[str, str] = ("a", "b")) -> list[dict[str, Any]]:
    """One result per sample pair: ``first_diff``, ``ok``, ``reason``, ``max_shared_logprob_gap``."""
    if len(samples_a) != len(samples_b):
        raise ValueError(f"{names[0]} has {len(samples_a)} samples, {names[1]} has {len(samples_b)}")
    return [{"index": i, **_check_one(a, b, names)} for i, (a, b) in enumerate(zip(samples_a, samples_b))]
