"""Checkpoints reshard across device meshes (issue 60, item 5; portrl.parity.mesh_reshard).

A state saved under TP2 x FSDP2 (4 ranks) loads under FSDP4 (4 ranks, started afresh) and under one rank with no
process group, weights and AdamW's exp_avg / exp_avg_sq / step equal bit for bit; the Hugging Face export of a
TP2 x FSDP2 model loads with from_pretrained and gives the one-rank logits; per-rank shard files work under a
Ulysses mesh and are refused under tensor parallelism and HSDP. Ranks are CPU processes over gloo.
"""

from __future__ import annotations

import pytest
import torch

from portrl.device.mesh_shape import MeshShape
from portrl.models.tiny import write_tiny_model
from portrl.parity.mesh_reshard import STATE, Phase, bitwise_differences, launch, run_phase
from portrl.parity.mesh_step import step_batch
from portrl.state_files import ShardedState, load_state

TP2_FSDP2, FSDP4, HSDP = MeshShape.of(4, tp=2), MeshShape.of(4), MeshShape.of(4, fsdp_size=2)
SP2, TP2 = MeshShape.of(2, sp=2), MeshShape.of(2, tp=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny model trained 2 steps under TP2 x FSDP2 (saved, exported, shards tried), then a fresh launch of 4
    ranks that loads that state under FSDP4 (saved at once, and after one more step) and under HSDP (shards
    tried)."""
    root = tmp_path_factory.mktemp("reshard")
    # portrl parity mesh's model: 4 query heads over 2 key/value heads, vocabulary 112 (tp=2 splits them)
    model_dir = str(write_tiny_model(root / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))
    d = {name: str(root / name) for name in ("tp2_fsdp2", "tp_shards", "hf", "fsdp4", "fsdp4_step", "hsdp_shards")}
    launch(4, [Phase(TP2_FSDP2, steps=2, save=d["tp2_fsdp2"], shards=d["tp_shards"], export=d["hf"])],
           model_dir, str(root / "ranks_tp"))
    launch(4, [Phase(FSDP4, load=d["tp2_fsdp2"], save=d["fsdp4"]),
               Phase(FSDP4, load=d["tp2_fsdp2"], steps=1, save=d["fsdp4_step"]),
               Phase(HSDP, load=d["tp2_fsdp2"], shards=d["hsdp_shards"])], model_dir, str(root / "ranks_fsdp4"))
    return root, model_dir, d


def test_tp2_fsdp2_to_fsdp4_to_one_rank_is_bitwise(work):
    root, model_dir, d = work
    saved = load_state(d["tp2_fsdp2"], STATE)
    moments = saved["optimizer"]["state"]["model.layers.0.self_attn.q_proj.weight"]
    assert set(moments) == {"step", "exp_avg", "exp_avg_sq"} and float(moments["step"]) == 2.0
    assert float(moments["exp_avg_sq"].abs().sum()) > 0
    assert bitwise_differences(load_state(d["fsdp4"], STATE), saved) == []
    run_phase(Phase(None, load=d["fsdp4"], save=str(root / "one")), model_dir)
    assert bitwise_differences(load_state(root / "one", STATE), saved) == []
    # the resumed run goes on: one more step on one rank is FSDP4's step to float32 reordering (parity bound)
    run_phase(Phase(None, load=d["fsdp4"], steps=1, save=str(root / "one_step")), model_dir)
    one, four = load_state(root / "one_step", STATE), load_state(d["fsdp4_step"], STATE)
    assert float(one["optimizer"]["state"]["model.norm.weight"]["step"]) == 3.0
    worst = max(float((one["model"][k] - v).abs().max()) for k, v in four["model"].items())
    assert worst <= 1e-5, worst  # measured 3.6e-8


def test_hf_export_from_tp2_fsdp2_gives_the_one_rank_logits(work):
    from transformers import AutoModelForCausalLM

    _, model_dir, d = work
    saved = load_state(d["tp2_fsdp2"], STATE)["model"]
    exported = AutoModelForCausalLM.from_pretrained(d["hf"]).eval()
    assert bitwise_differences(exported.state_dict(), saved) == []  # every tensor, the tied head included
    one = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    one.load_state_dict(saved)
    batch = step_batch()
    with torch.no_grad():
        want = one(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = exported(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(got, want)
    start = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():  # the export holds the trained weights, not the source's
        assert not torch.equal(start(batch["input_ids"]).logits, exported(batch["input_ids"]).logits)


def test_rank_shards_under_ulysses_and_refused_under_tensor_parallel_and_hsdp(work, tmp_path):
    _, model_dir, d = work
    f = {name: str(tmp_path / name) for name in ("sp_full", "sp_shards", "sp_again", "tp_from_shards")}
    launch(2, [Phase(SP2, steps=1, save=f["sp_full"], shards=f["sp_shards"]),
               Phase(SP2, load_shards=f["sp_shards"], save=f["sp_again"]),  # each rank reads its rows
               Phase(TP2, load_shards=f["sp_shards"], save=f["tp_from_shards"])],  # joined whole first
           model_dir, str(tmp_path / "ranks"))
    full = load_state(f["sp_full"], STATE)
    joined = ShardedState(tmp_path, "sp_shards").load()
    assert bitwise_differences({"model": joined["model"], "optimizer": joined["optimizer"]}, full) == []
    assert bitwise_differences(load_state(f["sp_again"], STATE), full) == []
    assert bitwise_differences(load_state(f["tp_from_shards"], STATE), full) == []
    for refused in (d["tp_shards"], d["hsdp_shards"]):  # 2-D placements: the mesh writes the full state instead
        message = open(f"{refused}.refused").read()
        assert message.startswith("cannot store a DTensor placed") and "2-D mesh" in message


def test_a_failing_rank_fails_the_launch_with_its_message(work, tmp_path):
    _, model_dir, _ = work
    with pytest.raises(RuntimeError, match=r"rank\d: StateFormatError: state.safetensors is missing"):
        launch(2, [Phase(MeshShape.of(2), load=str(tmp_path / "nothing"))], model_dir, str(tmp_path / "ranks"))
