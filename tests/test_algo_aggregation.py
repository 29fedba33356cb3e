"""agg_loss: every mode by hand, shards with global counts, DP errors, all-masked batches."""

import pytest
import torch

from portrl.algo import agg_loss, registered, trl_loss_type_to_agg_mode

L = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0], [2.0, 0.0, 1.0, 3.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def by_hand(mode, rows, n_tokens=None, n_seqs=None, k=None):
    sums = [sum(L[i, t].item() for t in range(4) if M[i, t]) for i in rows]
    counts = [int(M[i].sum()) for i in rows]
    valid = [c > 0 for c in counts]
    if mode == "token-mean":
        return sum(sums) / (n_tokens if n_tokens is not None else sum(counts))
    if mode == "token-sum":
        return sum(sums)
    bg = n_seqs if n_seqs is not None else sum(valid)
    if mode == "seq-mean-token-sum":
        return sum(s for s, v in zip(sums, valid) if v) / bg
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c, v in zip(sums, counts, valid) if v) / bg
    if mode == "seq-mean-token-sum-norm":
        return sum(s for s, v in zip(sums, valid) if v) / bg / (k if k is not None else 4)
    raise AssertionError(mode)


@pytest.mark.parametrize("mode", registered("loss_agg_mode"))
def test_modes_by_hand(mode):
    assert agg_loss(L, M, mode).item() == pytest.approx(by_hand(mode, range(4)))
    assert agg_loss(L.double(), M, mode).item() == pytest.approx(by_hand(mode, range(4)), rel=1e-12)


def test_seq_mean_token_sum_norm_loss_scale_factor():
    assert agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(
        by_hand("seq-mean-token-sum-norm", range(4), k=10))


@pytest.mark.parametrize("mode", registered("loss_agg_mode"))
def test_two_shards_with_global_counts_sum_to_whole_batch(mode):
    n_tok, n_seq = int(M.sum()), 4  # engine path: all rows count, masked ones included
    whole = agg_loss(L, M, mode, batch_num_tokens=n_tok, global_batch_size=n_seq)
    assert whole.item() == pytest.approx(by_hand(mode, range(4), n_tokens=n_tok, n_seqs=n_seq))
    shards = [(slice(0, 1), ), (slice(1, 4), )]
    parts = [agg_loss(L[s], M[s], mode, batch_num_tokens=n_tok, global_batch_size=n_seq) for (s,) in shards]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6)
    # data parallel: each rank multiplies by dp_size, DDP averages the ranks
    ranks = [agg_loss(L[s], M[s], mode, dp_size=2, batch_num_tokens=n_tok, global_batch_size=n_seq) for (s,) in shards]
    assert sum(r.item() for r in ranks) / 2 == pytest.approx(whole.item(), rel=1e-6)


def test_dp_without_global_counts_is_an_error():
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        with pytest.raises(ValueError, match="global count"):
            agg_loss(L, M, mode, dp_size=2)
    assert agg_loss(L, M, "token-sum", dp_size=2).item() == pytest.approx(2 * by_hand("token-sum", range(4)))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_all_masked_batch_is_an_error_but_an_empty_shard_is_zero(mode):
    z = torch.zeros_like(M)
    with pytest.raises(ValueError, match="all-masked"):
        agg_loss(L, z, mode)
    x = L.clone().requires_grad_()
    out = agg_loss(x, z, mode, batch_num_tokens=5, global_batch_size=4)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(L))


def test_unknown_mode_and_trl_aliases():
    with pytest.raises(KeyError, match="registered: seq-mean-token-mean"):
        agg_loss(L, M, "mean")
    assert agg_loss(L, M, "dapo").item() == agg_loss(L, M, "token-mean").item()
    assert agg_loss(L, M, "bnpo").item() == agg_loss(L, M, "token-mean").item()
    assert agg_loss(L, M, "grpo").item() == agg_loss(L, M, "seq-mean-token-mean").item()
    # Dr. GRPO: Σ ℓ m / (B · max_completion_length), with all B rows counted
    assert agg_loss(L, M, "dr_grpo", global_batch_size=4, loss_scale_factor=16).item() == pytest.approx(
        float((L * M).sum()) / (4 * 16))
    assert trl_loss_type_to_agg_mode("dr_grpo") == "seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match="valid: bnpo"):
        trl_loss_type_to_agg_mode("luspo")


def test_bf16_loss_aggregates_in_float32():
    out = agg_loss(L.to(torch.bfloat16), M, "token-mean")
    assert out.dtype == torch.float32 and out.item() == pytest.approx(by_hand("token-mean", range(4)))
