"""The vocabulary-parallel log-prob and entropy (portrl/ops/logprobs_tp.py): 2 and 3 CPU processes over gloo, each
holding its block of the LM head's rows, give the values and gradients of the full head in one process (float64:
within 1e-10 of the full logits; float32 and bfloat16: against the native op), identical on every rank, with an
uneven split, temperature, bias, labels at the blocks' edges, several row chunks and an unused output; a group of
one rank (or none) is the native op; a label no rank holds stops every rank with the same error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from portrl.ops.logprobs import logprobs_entropy, logprobs_entropy_full
from portrl.ops.logprobs_tp import vocab_parallel_logprobs_entropy
from _gloo_ranks import run_ranks

WORLDS = (2, 3)

# name -> (random rows added to the edge labels, vocab, hidden, dtype, temperature, bias, chunk_size, used outputs);
# the blocks are uneven (11 = 6 + 5 = 4 + 4 + 3, 13 = 7 + 6 = 5 + 5 + 3, 23 = 12 + 11 = 8 + 8 + 7) but for 10 = 5 + 5
CASES = {
    "f64-bias-temp-chunks": (3, 11, 5, torch.float64, 0.7, True, 2, ("logp", "entropy")),
    "f64-entropy-unused": (2, 13, 4, torch.float64, 1.3, False, 4, ("logp",)),
    "f64-logp-unused": (1, 10, 4, torch.float64, 1.0, True, 1, ("entropy",)),
    "f64-one-chunk": (4, 11, 3, torch.float64, 1.0, False, None, ("logp", "entropy")),
    "f32": (5, 23, 16, torch.float32, 0.9, True, 3, ("logp", "entropy")),
    "bf16": (5, 23, 16, torch.bfloat16, 1.0, True, 4, ("logp", "entropy")),
}

# float32, relative to the largest magnitude of each output (at least 1): logits of up to ~10 carry rounding of a few
# eps (1.2e-7) each, the entropy here is lse - t / s where the native op sums p z, and the ranks regroup the sums
# over the vocabulary (lse, t, dh); measured up to 2e-6 (entropy), so 1e-5 leaves five times that.
F32_BOUND = 1e-5
# bfloat16 gradients, relative likewise: values are still reduced in float32 (F32_BOUND), but each rank rounds its
# share of dh to bfloat16 (8 significant bits) before the sum, where the native op rounds once: measured one
# bfloat16 step of the largest entry; 2^-6 is at least two steps.
BF16_BOUND = 2 ** -6


def _shard(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank's block: ceil(V / world) rows each, the last block shorter."""
    per = math.ceil(vocab / world)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def _data(name: str) -> dict:
    extra, vocab, width, dtype, temperature, bias, chunk, used = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 1000 + vocab)
    edges = sorted({0, vocab - 1} | {e for w in WORLDS for r in range(1, w) for e in (_shard(vocab, w, r)[0] - 1,
                                                                                        _shard(vocab, w, r)[0])})
    labels = torch.cat([torch.tensor(edges), torch.randint(0, vocab, (extra,), generator=g)])
    n = labels.shape[0]

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g).to(dtype)

    return {"h": rand(n, width), "w": rand(vocab, width), "b": rand(vocab) if bias else None, "labels": labels,
            "g_logp": torch.randn(n, generator=g) if "logp" in used else None,
            "g_entropy": torch.randn(n, generator=g) if "entropy" in used else None,
            "temperature": temperature, "chunk": chunk}


def _grads(fn, d: dict, lo: int, hi: int, **kw) -> dict:
    """logp, entropy and the gradients of ``sum(g_logp logp + g_entropy entropy)`` for head rows ``[lo, hi)``."""
    h, w = d["h"].clone().requires_grad_(), d["w"][lo:hi].clone().requires_grad_()
    b = d["b"][lo:hi].clone().requires_grad_() if d["b"] is not None else None
    logp, entropy = fn(h, w, d["labels"], temperature=d["temperature"], bias=b, **kw)
    loss = sum((out * g.to(out.dtype)).sum() for out, g in ((logp, d["g_logp"]), (entropy, d["g_entropy"]))
               if g is not None)
    loss.backward()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "h": h.grad, "w": w.grad,
            "b": b.grad if b is not None else None}


def _parallel(group, lo):
    def fn(h, w, labels, temperature, bias, chunk_size):
        return vocab_parallel_logprobs_entropy(h, w, labels, lo, group, temperature, bias, chunk_size)
    return fn


def _rank_results(rank: int, world: int) -> dict:
    out: dict = {}
    for name in CASES:
        d = _data(name)
        lo, hi = _shard(d["w"].shape[0], world, rank)
        out[name] = _grads(_parallel(dist.group.WORLD, lo), d, lo, hi, chunk_size=d["chunk"])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating every group
    d = _data("f64-bias-temp-chunks")
    out["single"] = (_grads(_parallel(singles[rank], 0), d, 0, d["w"].shape[0], chunk_size=d["chunk"]),
                     _grads(logprobs_entropy, d, 0, d["w"].shape[0], chunk_size=d["chunk"]))
    lo, hi = _shard(d["w"].shape[0], world, rank)
    try:
        vocab_parallel_logprobs_entropy(d["h"], d["w"][lo:hi], d["labels"] + 1, lo, dist.group.WORLD)
        out["bad-label"] = None
    except ValueError as exc:
        out["bad-label"] = str(exc)
    return out


_RUNS: dict = {}  # world size -> {rank: results}: one set of processes per world size


def _run(world: int) -> dict:
    if world not in _RUNS:
        _RUNS[world] = run_ranks(_rank_results, world, timeout_s=120)
    return _RUNS[world]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_whole_head(world, name):
    results = _run(world)
    d = _data(name)
    vocab, dtype = d["w"].shape[0], d["h"].dtype
    ranks = [results[r][name] for r in range(world)]
    for r in range(1, world):  # the same logp, entropy and dh on every rank, bit for bit
        for key in ("logp", "entropy", "h"):
            assert torch.equal(ranks[r][key], ranks[0][key]), f"rank {r}'s {key} differs from rank 0's"
    got = dict(ranks[0], w=torch.cat([x["w"] for x in ranks]))
    if d["b"] is not None:
        got["b"] = torch.cat([x["b"] for x in ranks])
    assert got["logp"].dtype == got["entropy"].dtype == torch.promote_types(dtype, torch.float32)
    assert got["h"].dtype == got["w"].dtype == dtype
    want = (_grads(logprobs_entropy_full, d, 0, vocab) if dtype == torch.float64
            else _grads(logprobs_entropy, d, 0, vocab, chunk_size=d["chunk"]))
    for key, value in want.items():
        if value is None:
            assert got[key] is None, key
            continue
        if dtype == torch.float64:
            bound = 1e-10
        else:
            grad_bf16 = dtype == torch.bfloat16 and key not in ("logp", "entropy")
            bound = (BF16_BOUND if grad_bf16 else F32_BOUND) * max(1.0, value.abs().max().item())
        assert _max_diff(got[key], value) <= bound, (key, _max_diff(got[key], value), bound)


@pytest.mark.parametrize("world", WORLDS)
def test_a_group_of_one_rank_is_the_native_op(world):
    for r, ranks in _run(world).items():
        got, want = ranks["single"]
        for key in want:
            assert (got[key] is None and want[key] is None) or torch.equal(got[key], want[key]), (r, key)


@pytest.mark.parametrize("world", WORLDS)
def test_a_label_no_rank_holds_stops_every_rank(world):
    vocab = _data("f64-bias-temp-chunks")["w"].shape[0]
    for r, ranks in _run(world).items():
        msg = ranks["bad-label"]
        assert msg is not None and f"label {vocab} is in 0 shards" in msg, (r, msg)


def test_without_a_group_it_is_the_native_op():
    d = _data("f64-bias-temp-chunks")
    vocab = d["w"].shape[0]
    got = _grads(_parallel(None, 0), d, 0, vocab, chunk_size=d["chunk"])
    want = _grads(logprobs_entropy, d, 0, vocab, chunk_size=d["chunk"])
    for key in want:
        assert torch.equal(got[key], want[key]), key
    with pytest.raises(ValueError, match="vocab_start must be 0"):
        vocab_parallel_logprobs_entropy(d["h"], d["w"][3:], d["labels"] - 3, 3, None)
