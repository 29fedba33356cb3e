"""Checkpoints sharded by worker under FSDP2 (portrl/state_files.py, portrl/trainer/run_checkpoints.py): with 2 Ray
workers every rank writes its own shard of the actor, the critic and PRIME's PRM (model and optimizer rows, nothing gathered) and
no whole-model file exists; the shards join to the exported model exactly; a run resumed from them logs the same
next step as the uninterrupted run; one worker (``portrl eval``) loads them joined; a corrupted shard is skipped by
resume=auto and is a one-line error, exit 2, when named. The rows any number of ranks would own are read from the
files that hold them (resharding). One module-scoped local Ray."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.state_files import ShardedState, shard_rows  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402
from _ray_trainer import fit, logged_metrics  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from portrl.models import write_tiny_model

    p = str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))
    init_ray(_cfg(p, "unused"), get_backend("cpu"), num_cpus=4)
    yield p
    ray.shutdown()


def _cfg(path, out, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "trainer.output_dir": str(out),
            "trainer.num_workers": 2, "algorithm.adv_estimator": "gae", "actor.use_kl_loss": True,
            "data.arith.num_train": 64, "data.arith.num_test": 8, "data.train_batch_size": 4,
            "data.max_response_length": 5, "rollout.n": 2, "actor.ppo_mini_batch_size": 2, "actor.ppo_epochs": 1,
            "actor.ppo_micro_batch_size_per_device": 4, "actor.optim.lr": 1e-3, "actor.entropy_coeff": 0.01,
            "trainer.total_steps": 3, "trainer.save_freq": 2, "trainer.test_freq": 0, "trainer.progress_bar": False,
            "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": True, "trainer.seed": 3}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.mark.slow  # two Ray workers train, save shards, and a run resumes from them (40-65 s)
def test_two_fsdp_workers_write_a_shard_each_and_resume_exactly(tiny, tmp_path, monkeypatch, caplog):
    from safetensors.torch import load_file

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    ref_out = tmp_path / "ref"
    summary = fit(_cfg(tiny, ref_out))
    ckpt = ref_out / "checkpoints" / "global_step_2"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == ["actor/rank_0.json", "actor/rank_0.safetensors", "actor/rank_1.json", "actor/rank_1.safetensors",
                     "critic/rank_0.json", "critic/rank_0.safetensors", "critic/rank_1.json",
                     "critic/rank_1.safetensors", "manifest.json", "trainer.json", "trainer.safetensors"]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == set(files) - {"manifest.json"}  # every shard verified by its sha256

    # each rank holds only its rows; joined they are the model the run exported after its last step
    last = ref_out / "checkpoints" / "global_step_3"
    shards = [load_file(str(last / "actor" / f"rank_{r}.safetensors")) for r in (0, 1)]
    joined = ShardedState(last, "actor").load()
    exported = load_file(os.path.join(summary["export_dir"], "model.safetensors"))
    for name, whole in exported.items():
        torch.testing.assert_close(joined["model"][name], whole, rtol=0, atol=0, msg=name)
    emb = "model.model.embed_tokens.weight"
    assert [s[emb].shape[0] for s in shards] == [r[1] - r[0] for r in (shard_rows(exported[emb[6:]].shape[0], 2, 0),
                                                                       shard_rows(exported[emb[6:]].shape[0], 2, 1))]
    assert joined["optimizer"]["state"] and all(v["exp_avg"].shape == joined["model"][k].shape
                                                for k, v in joined["optimizer"]["state"].items())

    # a crash during step 3's checkpoint: its shard is damaged; resume=auto falls back to step 2 and logs step 3
    # exactly as the uninterrupted run did (timings aside)
    out = tmp_path / "crashed"
    shutil.copytree(ref_out, out)
    shard = out / "checkpoints" / "global_step_3" / "actor" / "rank_1.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", PORTRL_CACHE=str(tmp_path / "cache"))
    code = "import sys; from portrl.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "--log-level", "WARNING", "eval", "device.name=cpu",
                        "device.num_threads=1", f"model.path={tiny}", "data.arith.num_test=8", "--checkpoint",
                        str(shard.parent.parent)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "actor/rank_1.safetensors sha256 differs from the manifest" in r.stderr.strip().splitlines()[-1]

    resumed = fit(_cfg(tiny, out, **{"trainer.export_hf": False}))
    assert resumed["resumed_from"].endswith("global_step_2") and "global_step_3 is unusable" in caplog.text
    want, got = logged_metrics(ref_out), logged_metrics(out)
    assert got[3] == want[3] and want[3]["actor/grad_norm"] > 0 and "critic/vf_loss" in want[3]


def test_one_worker_evaluates_a_sharded_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    """``portrl eval`` (one in-process worker) joins the shards of a 2-worker checkpoint; rows of 3 ranks are
    read from the 2 ranks' files (resharding)."""
    from portrl.cli import main

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    fit(_cfg(tiny, out, **{"trainer.total_steps": 2, "algorithm.adv_estimator": "grpo", "actor.use_kl_loss": False,
                           "trainer.export_hf": False}))
    ckpt = out / "checkpoints" / "global_step_2"
    state = ShardedState(ckpt, "actor")
    whole = state.load()
    for name, t in whole["model"].items():
        parts = [state.load(rank, 3)["model"][name] for rank in range(3)]
        assert torch.equal(torch.cat(parts), t), name
    # an incomplete or mixed set of shards is one line naming the file (the manifest catches damage first)
    from portrl.state_files import StateFormatError

    copy = tmp_path / "copy"
    shutil.copytree(ckpt / "actor", copy / "actor")
    (copy / "actor" / "rank_1.safetensors").unlink()
    with pytest.raises(StateFormatError, match=r"actor/rank_1.safetensors is missing"):
        ShardedState(copy, "actor")
    shutil.copy(ckpt / "actor" / "rank_1.safetensors", copy / "actor")
    head = json.loads((copy / "actor" / "rank_1.json").read_text())
    head["__shards__"]["world_size"] = 3
    (copy / "actor" / "rank_1.json").write_text(json.dumps(head))
    with pytest.raises(StateFormatError, match=r"actor/rank_1.json says rank 1 of 3"):
        ShardedState(copy, "actor")
    report = tmp_path / "eval.json"
    argv = ["eval", "device.name=cpu", "device.num_threads=1", f"model.path={tiny}", "data.arith.num_test=8",
            "--checkpoint", str(ckpt), "--report", str(report)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "val/acc/mean" in json.loads(report.read_text())


def test_lora_adapters_under_fsdp_are_sharded_and_restored_exactly(tiny, tmp_path):
    """A LoRA run's shards hold the adapters and their optimizer state only (the frozen base is neither gathered
    nor written); joined they are rank 0's gathered state; loaded back by rank, the next update is the same."""
    from portrl.workers.actor import ActorRolloutWorker
    from portrl.workers.batch import build_rollout_batch
    from portrl.workers.group import WorkerGroup

    cfg = _cfg(tiny, tmp_path, **{"actor.lora_rank": 4, "actor.lora_alpha": 8,
                                  "actor.lora_target_modules": ["q_proj", "v_proj"], "actor.ppo_mini_batch_size": 4,
                                  "actor.optim.lr": 1e-2, "rollout.n": 4, "actor.use_kl_loss": False})
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor_lora_shards")
    try:
        g = torch.Generator().manual_seed(0)
        batch = build_rollout_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]],
                                    [[int(t) for t in torch.randint(3, 30, (5,), generator=g)] for _ in range(16)], n=4)
        batch["advantages"] = torch.randn(len(batch), 1, generator=g) * batch["response_mask"]
        group.metrics("update_actor", batch)
        group.run("save_shard", str(tmp_path), "actor")
        joined, gathered = ShardedState(tmp_path, "actor").load(), group.rank0("state_dict")
        assert set(joined["model"]) == set(gathered["model"]) and all(".lora_" in k for k in joined["model"])
        assert all(torch.equal(joined["model"][k], v) for k, v in gathered["model"].items())
        assert all(torch.equal(joined["optimizer"]["state"][k]["exp_avg"], v["exp_avg"])
                   for k, v in gathered["optimizer"]["state"].items())
        first = group.metrics("update_actor", batch)
        after = group.full_weights()
        group.run("load_shard", str(tmp_path), "actor")
        again = group.metrics("update_actor", batch)
        assert again["actor/grad_norm"] == first["actor/grad_norm"] > 0
        assert all(torch.equal(v, after[k]) for k, v in group.full_weights().items())
    finally:
        group.shutdown()


@pytest.mark.slow  # shards of two Ray ranks loaded by three (35-55 s)
def test_shards_of_two_ranks_load_into_three(tiny, tmp_path):
    """Resharding: 3 FSDP2 ranks each read their rows (torch.chunk's uneven cut) of a 2-rank actor state from the
    files that hold them; the model and optimizer state they then hold are the 2 ranks' exactly."""
    from portrl.workers.actor import ActorRolloutWorker
    from portrl.workers.batch import build_rollout_batch
    from portrl.workers.group import WorkerGroup

    cfg = _cfg(tiny, tmp_path, **{"actor.use_kl_loss": False, "rollout.n": 4, "actor.ppo_mini_batch_size": 4})
    two = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor_two")
    try:
        batch = build_rollout_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], [[3 + i % 20] * 4 for i in range(16)],
                                    n=4)
        batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(1) * batch["response_mask"]
        two.metrics("update_actor", batch)
        two.run("save_shard", str(tmp_path), "actor")
        want = two.rank0("state_dict")
    finally:
        two.shutdown()
    three = WorkerGroup(ActorRolloutWorker, cfg, 3, get_backend("cpu"), role="actor_three")
    try:
        three.run("load_shard", str(tmp_path), "actor")
        got = three.rank0("state_dict")
    finally:
        three.shutdown()
    assert want["optimizer"]["state"] and set(got["model"]) == set(want["model"])
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert all(torch.equal(got["optimizer"]["state"][k][m], t) for k, s in want["optimizer"]["state"].items()
               for m, t in s.items())

# PRIME with an SFT warm start: the actor and the implicit PRM both sharded over the two FSDP2 workers
PRIME = {"algorithm.adv_estimator": "prime", "data.filter_accuracy": False, "actor.use_kl_loss": False,
         "actor.entropy_coeff": 0.0, "reward_model.model.optim.lr": 1e-2, "model.sft_warm_start": True,
         "model.sft_steps": 4, "model.sft_batch_size": 8, "trainer.export_hf": False}


@pytest.mark.slow
def test_prime_run_shards_its_prm_and_resumes_exactly(tiny, tmp_path, monkeypatch):
    """About 110 s on 2 cores: two PRIME runs of two FSDP2 Ray workers each for the actor and the PRM (the warm
    start handed to the sharded PRM, its shards written, read back by rank), the smallest setting that does it."""
    from portrl.state_files import ShardedState

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    ref_out = tmp_path / "ref"
    fit(_cfg(tiny, ref_out, **PRIME))
    ckpt = ref_out / "checkpoints" / "global_step_2"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("prm")] == ["prm/rank_0.json", "prm/rank_0.safetensors",
                                                          "prm/rank_1.json", "prm/rank_1.safetensors"]
    joined = ShardedState(ckpt, "prm").load()
    assert {"model", "optimizer", "scheduler", "ref"} <= set(joined)  # the reference: the warm-started policy
    assert joined["optimizer"]["state"] and all(v["exp_avg"].shape == joined["model"][k].shape
                                                for k, v in joined["optimizer"]["state"].items())
    out = tmp_path / "resumed"
    shutil.copytree(ref_out, out)
    shutil.rmtree(out / "checkpoints" / "global_step_3")
    resumed = fit(_cfg(tiny, out, **PRIME))
    assert resumed["resumed_from"].endswith("global_step_2")
    want, got = logged_metrics(ref_out), logged_metrics(out)
    assert got[3] == want[3] and want[3]["reward_model/grad_norm"] > 0
