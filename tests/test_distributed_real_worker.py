"""The real ActorRolloutWorker (and the trainer) over 2 Ray workers and gloo, FSDP2 (strategy auto) and DDP: the same
update as 1 worker on the whole batch, rollouts of several ranks merged, the engine's copy synced after an
update, checkpoints portable between 1 and 2 workers, run_training with trainer.num_workers=2, and a killed
worker stopping the trainer with the last good checkpoint named. One module-scoped local Ray."""

import copy
import json
import math
import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402
from portrl.workers.batch import Batch  # noqa: E402
from portrl.workers.group import WorkerDiedError, WorkerGroup  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402
from _random_batch import random_rollout_batch as _batch  # noqa: E402

SAMPLING = {"n": 4, "temperature": 1.0, "max_new_tokens": 5, "seed": 3}


def _cfg(path, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
            "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_device": 3,
            "actor.ppo_epochs": 2, "actor.optim.lr": 1e-2, "actor.optim.grad_clip": 0.5,
            # Adam's first step is ~lr*sign(g); a large eps makes it ~lr*g, so float noise stays small
            "actor.optim.eps": 1.0}
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from portrl.models import write_tiny_model

    p = str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2,
                             num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))
    init_ray(_cfg(p), get_backend("cpu"), num_cpus=4)
    yield p
    ray.shutdown()


@pytest.fixture(scope="module")
def group(path):
    g = WorkerGroup(ActorRolloutWorker, _cfg(path), 2, get_backend("cpu"), role="actor")
    yield g
    g.shutdown()


def _assert_same_weights(got, want, atol=1e-5):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=k)


def test_rollouts_of_two_ranks_merge(group):
    # rank 0 gets the short prompts, rank 1 the long ones: the ranks' batches have different widths
    ids = [[5, 6], [7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23]]
    prompts = Batch(meta={"prompt_ids": ids, "uid": ["a", "b", "c", "d"]})
    out = group.concat("generate_from", prompts, SAMPLING)
    assert len(out) == 16 and out["uid"] == [u for u in "abcd" for _ in range(4)]
    P = out["prompts"].shape[1]
    assert P == 8 and out["input_ids"].shape[1] == P + out["responses"].shape[1]
    for r in range(16):
        mask = out["attention_mask"][r].bool()
        assert out["input_ids"][r][mask][:len(ids[r // 4])].tolist() == ids[r // 4]
        assert out["attention_mask"][r, :P].sum() == len(ids[r // 4])
    assert torch.equal(out["attention_mask"][:, P:], out["response_mask"])
    # each rank's engine (a full copy under FSDP2) generated with the policy's weights
    lp = group.concat("compute_log_probs", out)["old_log_probs"]
    torch.testing.assert_close(lp * out["response_mask"], out["rollout_log_probs"], atol=1e-4, rtol=0)


def test_two_workers_match_one_then_checkpoints_move_between_sizes(path, group):
    cfg = _cfg(path)
    assert group.gather("__getattribute__", "strategy") == ["fsdp", "fsdp"]
    ref = ActorRolloutWorker(cfg)  # one rank, the whole batch
    b = _batch(1)
    old = ref.compute_log_probs(b)
    torch.testing.assert_close(group.concat("compute_log_probs", b)["old_log_probs"], old["old_log_probs"],
                               atol=1e-5, rtol=0)
    b.union(Batch({"old_log_probs": old["old_log_probs"]}))
    m1 = ref.update_actor(b)
    m2 = group.metrics("update_actor", b)
    assert m1["actor/grad_norm"] > 0.5  # clipping was active on both sides
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-4, abs=1e-6)
    want = {k: v.detach().clone() for k, v in ref.named_weights()}
    _assert_same_weights(group.full_weights(), want)

    # after the sync, each rank's engine copy samples with the updated policy
    group.run("sync_weights")
    prompts = Batch(meta={"prompt_ids": [[5, 6, 7], [8, 9]], "uid": ["a", "b"]})
    out = group.concat("generate_from", prompts, SAMPLING)
    lp = group.concat("compute_log_probs", out)["old_log_probs"]
    torch.testing.assert_close(lp * out["response_mask"], out["rollout_log_probs"], atol=1e-4, rtol=0)

    # a 2-rank checkpoint (full tensors, optimizer state included) resumes in 1 worker ...
    b2 = _batch(2)
    b2.union(Batch({"old_log_probs": ref.compute_log_probs(b2)["old_log_probs"]}))
    ref_state = copy.deepcopy(ref.state_dict())  # the live tensors change with the next update
    one = ActorRolloutWorker(cfg)
    one.load_state_dict(group.rank0("state_dict"))
    _assert_same_weights(dict(one.named_weights()), want)
    ref.update_actor(b2)
    one.update_actor(b2)
    after = {k: v.detach().clone() for k, v in ref.named_weights()}
    _assert_same_weights(dict(one.named_weights()), after)
    # ... and a 1-worker checkpoint resumes in 2 ranks (the group first moves away from it)
    group.metrics("update_actor", _batch(3))
    group.run("load_state_dict", ref_state)
    group.metrics("update_actor", b2)
    _assert_same_weights(group.full_weights(), after)


def test_bf16_under_fsdp_trains_float32_shards_and_checkpoints_move_to_one_worker(path):
    """bfloat16 compute: FSDP2 keeps float32 sharded parameters (MixedPrecisionPolicy), one worker keeps float32
    masters (portrl.workers.master_weights); both update alike and share one checkpoint format."""
    cfg = _cfg(path, **{"device.dtype": "bfloat16", "actor.ppo_epochs": 1})
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor_bf16")
    try:
        assert group.gather("__getattribute__", "strategy") == ["fsdp", "fsdp"]
        ref = ActorRolloutWorker(cfg)
        assert ref.master.active and next(ref.module.parameters()).dtype == torch.bfloat16
        b = _batch(5)
        m1, m2 = ref.update_actor(b), group.metrics("update_actor", b)
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=0.02)
        state = group.rank0("state_dict")
        floats = {k: v for k, v in state["model"].items() if v.is_floating_point()}
        assert floats and all(v.dtype == torch.float32 for v in floats.values())
        want = ref.state_dict()["model"]
        assert all(want[k].dtype == torch.float32 for k in floats)  # the masters (tied lm_head included)
        for k in floats:  # the same float32 masters, to bfloat16 compute noise
            torch.testing.assert_close(floats[k], want[k], rtol=0, atol=2e-5, msg=k)
        one = ActorRolloutWorker(cfg)
        one.load_state_dict(state)
        for n, m in zip(one.master.names, one.master.masters):
            assert torch.equal(m.detach(), state["model"][n])
    finally:
        group.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_under_fsdp_with_checkpointing_matches_one_worker(path, tmp_path, dtype):
    """LoRA adapters under FSDP2 with gradient checkpointing (float32, and bfloat16 compute over float32 shards):
    every rank builds the same adapters (their init is seeded by trainer.seed; unseeded, each Ray worker drew its
    own and the shards mixed them), so 2 ranks give the update of 1 rank on the whole batch; only the adapters
    train; the checkpoint (adapters and their optimizer state, no base model) resumes in 1 worker; the export is
    the merged model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = _cfg(path, **{"actor.lora_rank": 4, "actor.lora_alpha": 8, "actor.lora_target_modules": ["q_proj", "v_proj"],
                        "model.gradient_checkpointing": True, "actor.ppo_epochs": 1, "device.dtype": dtype})
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role=f"actor_lora_{dtype}")
    try:
        assert group.gather("__getattribute__", "strategy") == ["fsdp", "fsdp"]
        ref = ActorRolloutWorker(cfg)
        b = _batch(6)
        m1, m2 = ref.update_actor(b), group.metrics("update_actor", b)
        assert m1["actor/grad_norm"] > 0
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4 if dtype == "float32" else 0.02)

        # the train state is the adapters and their optimizer state, in float32 on both sides
        state, want = group.rank0("state_dict"), copy.deepcopy(ref.state_dict())
        assert set(state["model"]) == set(want["model"]) and all(".lora_" in k for k in state["model"])
        assert set(state["optimizer"]["state"]) == set(state["model"])
        assert len(state["model"]) == 2 * 2 * 2  # (A, B) x (q_proj, v_proj) x 2 layers
        gap = max(float((state["model"][k] - want["model"][k]).abs().max()) for k in want["model"])
        assert all(v.dtype == torch.float32 for v in state["model"].values())
        assert gap < (1e-7 if dtype == "float32" else 5e-5), gap  # bf16: measured 9.9e-6 (largest B entry 1.3e-3)
        assert any(float(v.abs().max()) > 0 for k, v in state["model"].items() if "lora_B" in k)  # B left zero

        # the base model is untouched: merged = base + (alpha/r) B A on the adapted layers, the file's elsewhere
        merged = group.full_weights()
        base = load_file(os.path.join(path, "model.safetensors"))
        for name, w in base.items():
            got = merged[name].float()
            owner = name[: -len(".weight")]
            a_key = f"base_model.model.{owner}.lora_A.default.weight"
            if a_key in state["model"]:
                got = got - 2.0 * state["model"][a_key.replace("lora_A", "lora_B")] @ state["model"][a_key]
                torch.testing.assert_close(got, w.float(), rtol=0, atol=1e-6, msg=name)
            else:
                assert torch.equal(got, w.float()), name
        _assert_same_weights(merged, {k: v.detach().clone().float() for k, v in ref.named_weights()},
                             atol=1e-5 if dtype == "float32" else 4e-3)

        # the 2-rank checkpoint resumes in 1 worker: its adapters exactly, then the 2 ranks' next update
        one = ActorRolloutWorker(cfg)
        one.load_state_dict(state)
        assert all(torch.equal(m.detach(), state["model"][n]) for n, m in zip(one.master.names, one.master.masters))
        b2 = _batch(7)
        one.update_actor(b2)
        group.metrics("update_actor", b2)
        after, want = group.rank0("state_dict")["model"], one.state_dict()["model"]
        gap2 = max(float((after[k] - want[k]).abs().max()) for k in want)
        assert gap2 < (1e-7 if dtype == "float32" else 2e-5), gap2
        moved = max(float(v.abs().max()) for k, v in state["model"].items() if "lora_B" in k)  # B started at 0
        print(f"LoRA {dtype}: 2 ranks vs 1, largest adapter difference after step 1 {gap:.2e} (largest B entry "
              f"{moved:.2e}), after a resume in 1 worker and step 2 {gap2:.2e}")

        # the export is the merged model, written by rank 0 while every rank joins the gather
        out = group.rank0("export_hf", str(tmp_path / "hf"))
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        assert not any("lora_" in k or "base_layer" in k for k in exported)
        merged = group.full_weights()
        _assert_same_weights({k: exported[k] for k in merged}, {k: v.float() for k, v in merged.items()},
                             atol=0 if dtype == "float32" else 4e-3)
    finally:
        group.shutdown()


def test_ddp_real_workers_match_one(path):
    cfg = _cfg(path, **{"actor.strategy": "ddp"})
    group = WorkerGroup(ActorRolloutWorker, cfg, 2, get_backend("cpu"), role="actor_ddp")
    try:
        assert group.gather("__getattribute__", "strategy") == ["ddp", "ddp"]
        ref = ActorRolloutWorker(cfg)
        b = _batch(4)
        m1, m2 = ref.update_actor(b), group.metrics("update_actor", b)  # on-policy: old = logp.detach()
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4) and m1["actor/grad_norm"] > 0.5
        _assert_same_weights(group.full_weights(), {k: v.detach().clone() for k, v in ref.named_weights()})
    finally:
        group.shutdown()


def _run_cfg(path, out, **over):
    base = {"trainer.num_workers": 2, "trainer.output_dir": str(out), "data.arith.num_train": 64,
            "data.arith.num_test": 8, "data.train_batch_size": 4, "data.max_response_length": 5,
            "actor.ppo_micro_batch_size_per_device": 4, "actor.ppo_epochs": 1, "actor.optim.eps": 1e-8,
            "trainer.total_steps": 2, "trainer.save_freq": 1, "trainer.test_freq": 2, "trainer.progress_bar": False,
            "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": True}
    base.update(over)
    return _cfg(path, **base)


def test_run_training_with_two_workers_then_a_killed_worker(path, tmp_path, monkeypatch):
    from omegaconf import read_write

    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    trainer = RLTrainer(settle_config(_run_cfg(path, out)))
    try:
        assert trainer.actor.num_workers == 2 and isinstance(trainer.actor, WorkerGroup)
        summary = trainer.fit()
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert summary["steps"] == 2 and [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
        assert all(math.isfinite(r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r)
        assert "val/acc/mean" in rows[-1]
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(summary["export_dir"]).state_dict()
        _assert_same_weights({k: exported[k] for k in trainer.actor.full_weights()}, trainer.actor.full_weights(),
                             atol=0)

        pid = trainer.actor.info[1]["pid"]
        os.kill(pid, 9)
        with read_write(trainer.cfg.trainer):  # the settled config is read-only: this test extends the run in place
            trainer.cfg.trainer.total_steps = 3
            trainer.cfg.trainer.resume = "off"
        with pytest.raises(WorkerDiedError) as err:
            trainer.fit()
        msg = str(err.value)
        assert "actor" in msg and "rank 1" in msg and f"pid {pid}" in msg
        assert str(out / "checkpoints" / "global_step_2") in msg
    finally:
        trainer.actor.shutdown()


def test_sft_warm_start_on_two_workers(path, group):
    """The SFT warm start runs through the data-parallel wrapper (each rank its own examples)."""
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b)}
            for a in range(6) for b in range(4)]
    before = {k: v.detach().clone() for k, v in group.full_weights().items()}
    metrics = group.gather("run_sft", rows, 3, 1e-2, 4)
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["sft/loss_last"])) for m in metrics)
    after = group.full_weights()
    assert any(not torch.equal(after[k], before[k]) for k in before)
