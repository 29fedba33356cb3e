"""The memory plan of the offload levers (portrl/plan/memory.py's HELD): each lowers exactly the phases that do not
read what it moves, on an accelerator; on the CPU (the host is the device) none lowers anything; verl's names are
aliases of portrl's keys; and the search for a change that fits offers them."""

from __future__ import annotations

import json

import pytest

from portrl.config.composition import compose
from portrl.plan.fit import smallest_fix
from portrl.plan.run_plan import Device, plan_run
from portrl.plan.shape import shape_of_folder

QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
GPU = Device(dtype="bfloat16", host=False)
BASE = ["trainer.num_workers=8", "actor.use_kl_loss=true", "model.gradient_checkpointing=true",
        "data.max_prompt_length=512", "data.max_response_length=2048", "actor.max_tokens_per_micro_batch=16384"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("q7")
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return path


def _phases(folder, *over, world=8, device=GPU, preset="h100"):
    cfg = compose(preset=preset, overrides=[f"model.path={folder}", *BASE, *over])
    plan = plan_run(cfg, shape_of_folder(folder), world, 80 * 2**30, device=device)
    return {p.phase: p for p in plan.phases}


def _lowered(folder, *lever, run=(), **kw):
    """phase -> (bytes without the lever - bytes with it), and the phases of the run (``run``: its overrides)
    without it."""
    off, on = _phases(folder, *run, **kw), _phases(folder, *run, *lever, **kw)
    return {k: off[k].bytes - on[k].bytes for k in off}, off


def test_optimizer_offload_lowers_every_phase_but_the_update(folder):
    drop, plain = _lowered(folder, "actor.offload.optimizer=true")
    moments = plain["gen"].terms["adamw_moments"]
    assert moments == 8 * shape_of_folder(folder).params // 8  # float32 moments over 8 FSDP shards
    assert drop == {"gen": moments, "logp": moments, "ref": moments, "update_actor": 0}


def test_params_offload_under_fsdp_lowers_what_does_not_gather_the_shards(folder):
    drop, plain = _lowered(folder, "actor.offload.params=true")
    shards = plain["gen"].terms["weights"]
    assert drop == {"gen": shards, "logp": 0, "ref": shards, "update_actor": 0}  # old log-probs gather them


def test_params_offload_on_one_device_moves_the_16bit_runs_masters(folder):
    drop, plain = _lowered(folder, "actor.offload.params=true", run=["trainer.num_workers=1"], world=1)
    masters = plain["gen"].terms["master_weights"]
    assert drop == {"gen": masters, "logp": masters, "ref": masters, "update_actor": 0}


def test_reference_offload_and_activation_offload(folder):
    drop, plain = _lowered(folder, "ref.param_offload=true")
    ref = plain["gen"].terms["reference"]
    assert drop == {"gen": ref, "logp": ref, "ref": 0, "update_actor": ref}
    drop, plain = _lowered(folder, "actor.offload.activations=true")
    assert drop["update_actor"] > 0 and drop["gen"] == drop["logp"] == drop["ref"] == 0
    assert drop["update_actor"] < plain["update_actor"].terms["activations"]  # one layer's stays on the device


def test_critic_offload_lowers_the_actor_phases(folder):
    drop, plain = _lowered(folder, "critic.offload.params=true", "critic.offload.optimizer=true",
                           run=["algorithm.adv_estimator=gae"])
    critic = plain["gen"].terms["critic"] + plain["gen"].terms["critic_adamw"]
    assert drop["gen"] == drop["update_actor"] == critic
    assert drop["values"] == plain["gen"].terms["critic_adamw"] and drop["update_critic"] == 0


def test_on_the_cpu_the_levers_lower_nothing(folder):
    levers = ["actor.offload.params=true", "actor.offload.optimizer=true", "actor.offload.activations=true",
              "ref.param_offload=true"]
    drop, _ = _lowered(folder, *levers, preset="cpu", device=Device(dtype="float32", host=True))
    assert set(drop.values()) == {0}


def test_verl_names_are_aliases():
    cfg = compose(overrides=["actor_rollout_ref.actor.fsdp_config.param_offload=true",
                             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                             "actor_rollout_ref.model.enable_activation_offload=true",
                             "actor_rollout_ref.ref.fsdp_config.param_offload=true",
                             "critic.model.fsdp_config.optimizer_offload=true"])
    assert cfg.actor.offload.params and cfg.actor.offload.optimizer and cfg.actor.offload.activations
    assert cfg.ref.param_offload and cfg.critic.offload.optimizer and not cfg.critic.offload.params


def test_the_change_that_fits_can_be_an_offload_lever(folder):
    cfg = compose(preset="h100", overrides=[f"model.path={folder}", *BASE, "trainer.num_workers=2",
                                             "rollout.gpu_memory_utilization=0.3"])
    shape = shape_of_folder(folder)
    plan = plan_run(cfg, shape, 2, 80 * 2**30, device=GPU)
    assert plan.fits is False and plan.peak.phase == "gen"
    assert smallest_fix(cfg, shape, 2, 80 * 2**30, GPU) == "actor.offload.optimizer=True"
