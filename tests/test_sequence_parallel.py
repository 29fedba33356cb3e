"""Ulysses sequence parallelism's exchanges (portrl.models.sequence_parallel) over gloo with 2 and 4 CPU ranks, and
the mesh parity tier's comparison (portrl.parity.mesh). The whole tier (GRPO steps of a real Qwen2 under each mesh
against one rank) is a step of .ci/run: `portrl parity mesh`."""

from __future__ import annotations

import copy
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from portrl.models.sequence_parallel import (expand_kv_heads, gather_tokens, heads_to_sequence, sequence_to_heads,
                                             shard_tokens)
from portrl.parity.mesh import CASES, case_named, compare
from portrl.workers.parallel import find_free_port


def _exchanges(rank: int, world: int) -> None:
    """Every check of one rank; raises on a mismatch."""
    torch.manual_seed(0)
    full = torch.randn(1, 8, 12, 3, dtype=torch.float64, requires_grad=True)
    size = 12 // world
    local = full[:, :, rank * size:(rank + 1) * size].detach().requires_grad_(True)
    heads = sequence_to_heads(local, None)
    h = 8 // world
    assert torch.equal(heads, full[:, rank * h:(rank + 1) * h].detach()), "sequence_to_heads is not the slice"
    back = heads_to_sequence(heads, None)
    assert torch.equal(back, local), "heads_to_sequence is not its inverse"
    weight = torch.randn(full.shape, dtype=torch.float64)
    (back * weight[:, :, rank * size:(rank + 1) * size]).sum().backward()  # d/dlocal = weight's slice, through both
    assert local.grad is not None and torch.allclose(local.grad, weight[:, :, rank * size:(rank + 1) * size]), "all-to-all backward"
    # gather: every rank computes the same loss of the gathered rows; backward sums the ranks' (equal) gradients
    rows = torch.randn(12, 4, dtype=torch.float64)
    mine = rows[rank * size:(rank + 1) * size].clone().requires_grad_(True)
    gathered = gather_tokens(mine, None)
    assert torch.equal(gathered, rows)
    (gathered * rows).sum().backward()
    assert mine.grad is not None and torch.equal(mine.grad, world * rows[rank * size:(rank + 1) * size]), "gather backward is not the sum"
    # packed tokens: 10 tokens in 3 sequences, padded to a multiple of the ranks with a sequence of its own
    ids, pos = torch.arange(1, 11), torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    cu = torch.tensor([0, 3, 5, 10], dtype=torch.int32)
    part = shard_tokens(ids, pos, cu, 5, None)
    pad = -10 % world
    padded = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
    step = (10 + pad) // world
    assert torch.equal(part.input_ids, padded[rank * step:(rank + 1) * step]) and part.n == 10
    expect_cu = [0, 3, 5, 10] + ([10 + pad] if pad else [])
    assert part.cu_seqlens.tolist() == expect_cu and part.max_len == max(5, pad)


def _child(rank: int, world: int, port: int, errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        _exchanges(rank, world)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.parametrize("world", [2, 4])
def test_exchanges_match_slicing_and_sum_gradients(world):
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs)


def test_kv_heads_repeat_so_query_heads_keep_their_group():
    kv = torch.arange(2.0).reshape(1, 2, 1, 1)  # key/value heads 0 and 1, for 4 query heads (2 per kv head)
    assert expand_kv_heads(kv, 2) is kv
    rep = expand_kv_heads(kv, 4)  # sp=4: rank r gets query head r, which reads kv head r // 2
    assert rep.flatten().tolist() == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="one must divide the other"):
        expand_kv_heads(torch.zeros(1, 3, 1, 1), 2)


def _result(ref: dict, **scale: float) -> dict:
    out = copy.deepcopy(ref)
    for key, factor in scale.items():
        if key == "param_norms":
            out[key] = {k: v * factor for k, v in out[key].items()}
        elif key == "logp":
            out[key] = [[[x + factor for x in row] for row in step] for step in out[key]]
        else:
            out[key] = [x * factor for x in out[key]]
    return out


def test_compare_fails_a_doubled_gradient_or_a_moved_log_prob():
    ref = {"logp": [[[-1.0, -2.0]]], "loss": [0.5], "grad_norm": [1.5], "param_norms": {"w": 3.0, "b": 0.001}}
    assert compare(_result(ref, grad_norm=1 + 1e-7), ref)["verdict"] == "pass"
    assert compare(_result(ref, grad_norm=2.0), ref)["verdict"] == "fail"
    assert compare(_result(ref, logp=1e-3), ref)["verdict"] == "fail"
    assert compare(_result(ref, loss=1.001), ref)["verdict"] == "fail"
    assert compare(_result(ref, param_norms=1.01), ref)["verdict"] == "fail"
    missing = _result(ref)
    del missing["param_norms"]["b"]
    missing["param_norms"]["c"] = 0.001
    assert compare(missing, ref)["verdict"] == "fail"


def test_mesh_cases_cover_the_issue_list_and_unknown_names_are_refused():
    assert {c.name for c in CASES} >= {"tp2", "sp2", "tp2_fsdp2", "sp2_fsdp2"}
    assert [c.name for c in case_named(["sp2"])] == ["sp2"]
    with pytest.raises(ValueError, match="valid: tp2, sp2"):
        case_named(["tp3"])
