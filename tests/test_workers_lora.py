"""LoRA in the actor (actor.lora_rank > 0): only adapters train, the colocated engine samples with the
adapters, an engine with its own copy gets merged weights, the HF export is the merged model, and a GRPO run
with LoRA trains."""

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
pytest.importorskip("peft")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402

SAMPLING = {"n": 4, "temperature": 1.0, "max_new_tokens": 5, "seed": 7}


def _cfg(path, out=None, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
            "data.max_response_length": 5, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 5e-2,
            "actor.lora_rank": 4, "actor.lora_alpha": 8}
    if out is not None:
        base.update({"trainer.output_dir": str(out), "data.arith.num_train": 64, "data.arith.num_test": 8,
                     "data.train_batch_size": 4, "trainer.total_steps": 2, "trainer.test_freq": 0,
                     "trainer.val_before_train": False, "trainer.progress_bar": False, "trainer.loggers": ["jsonl"],
                     "trainer.plot": False, "trainer.save_final": False})
    base.update(over)
    for k, v in base.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _split(worker):
    """(adapter params, base params) of the worker's policy by name, detached copies."""
    named = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    return ({n: t for n, t in named.items() if "lora_" in n}, {n: t for n, t in named.items() if "lora_" not in n})


def _updated_worker(path):
    w = ActorRolloutWorker(_cfg(path))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    b = w.generate(prompts, SAMPLING, meta={"uid": list("abcd")})
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    b["advantages"] *= b["response_mask"]
    lora0, base0 = _split(w)
    w.update_actor(b)
    w.sync_weights()
    return w, prompts, lora0, base0


def test_only_adapters_train_and_engines_sample_the_adapted_policy(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from portrl.models import compute_logprobs
    from portrl.rollout import SamplingParams, make_engine

    w, prompts, lora0, base0 = _updated_worker(tiny_model)
    trained = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in w.module.named_parameters() if "lora_" in n} and lora0
    lora1, base1 = _split(w)
    assert all(torch.equal(base0[n], base1[n]) for n in base0)  # the base model is frozen
    assert any(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n)  # B left its zero init

    # the colocated engine shares the peft module: its forward already applies the adapters
    assert w.engine.model is w.module and w.sync_weights() is False
    b = w.generate(prompts, SAMPLING)
    lp = w.compute_log_probs(b)["old_log_probs"]
    torch.testing.assert_close(lp * b["response_mask"], b["rollout_log_probs"], atol=1e-4, rtol=0)

    # an engine with a model of its own gets merged weights (base names, W + (alpha/r) B A)
    own = make_engine("hf", model_path=tiny_model, tokenizer=w.tokenizer, backend=w.backend)
    names = dict(w.named_weights())
    assert not any("lora_" in n or "base_layer" in n for n in names) and set(names) == set(own.model.state_dict())
    own.update_weights(w.named_weights())
    out = own.generate(prompts, SamplingParams(**SAMPLING))
    b2 = w.generate(prompts, SAMPLING)  # same seed, same policy: the two engines sample the same tokens
    resp = [b2["responses"][i][b2["response_mask"][i].bool()].tolist() for i in range(len(b2))]
    assert resp == [list(x) for x in out.response_ids]
    for i, row in enumerate(out.logprobs):
        torch.testing.assert_close(torch.tensor(row), b2["rollout_log_probs"][i, :len(row)], atol=1e-4, rtol=0)

    # the HF export is the merged model: plain transformers reproduces the policy's log-probs
    exported = AutoModelForCausalLM.from_pretrained(w.export_hf(str(tmp_path / "hf")))
    assert not any("lora_" in n for n in exported.state_dict())
    with torch.no_grad():
        ex, _ = compute_logprobs(exported, b["input_ids"], b["attention_mask"], b["responses"].shape[1])
    torch.testing.assert_close(ex * b["response_mask"], lp * b["response_mask"], atol=1e-5, rtol=0)


def test_grpo_with_lora_trains_adapters_only(tiny_model, tmp_path, monkeypatch):
    """Also: the run's checkpoint holds the adapters, not the frozen base, and the run resumes from it."""
    from safetensors import safe_open

    from portrl.trainer.resources import settle_config
    from portrl.trainer.rl_trainer import RLTrainer

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_model, tmp_path / "run", **{"algorithm.adv_estimator": "grpo", "trainer.save_final": True})
    trainer = RLTrainer(settle_config(cfg))
    worker = trainer.actor.local_worker
    lora0, base0 = _split(worker)
    summary = trainer.fit()
    assert summary["steps"] == 2
    lora1, base1 = _split(worker)
    assert all(torch.equal(base0[n], base1[n]) for n in base0)
    assert set(lora1) == set(lora0)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all('"actor/pg_loss"' in r for r in rows)

    with safe_open(str(tmp_path / "run" / "checkpoints" / "global_step_2" / "actor.safetensors"), "pt") as f:
        saved = {k[len("model."):] for k in f.keys() if k.startswith("model.")}
    assert saved == set(lora1)
    cfg.trainer.total_steps = 3
    again = RLTrainer(settle_config(cfg))
    assert all(torch.equal(p, lora1[n]) for n, p in _split(again.actor.local_worker)[0].items())
    assert again.fit()["steps"] == 3


def test_adapter_init_depends_on_the_seed_only(tiny_model):
    """Every data-parallel rank must build the same adapters (FSDP2 broadcasts nothing), whatever drew random
    numbers before in that process."""
    first = _split(ActorRolloutWorker(_cfg(tiny_model)))[0]
    torch.rand(1000)  # another process's (or flag's) earlier draws
    again = _split(ActorRolloutWorker(_cfg(tiny_model, **{"model.gradient_checkpointing": True})))[0]
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    other = _split(ActorRolloutWorker(_cfg(tiny_model, **{"trainer.seed": 1})))[0]
    assert any(not torch.equal(first[n], other[n]) for n in first if "lora_A" in n)


def _one_update(path, **over):
    """A worker after one update on a fixed batch, and the calls of its first attention block's forward."""
    w = ActorRolloutWorker(_cfg(path, **over))
    calls = []
    w.module.get_base_model().model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    b = w.generate([[5, 6, 7], [8, 9]], SAMPLING, meta={"uid": list("ab")})
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    b["advantages"] *= b["response_mask"]
    calls.clear()  # the rollout's forwards
    lora0, base0 = _split(w)
    w.update_actor(b)
    return w, len(calls), lora0, base0


def test_lora_with_gradient_checkpointing_trains_the_adapters(tiny_model):
    """Gradient checkpointing recomputes the blocks in backward and gives the update without it. With frozen
    embeddings a reentrant checkpoint would pass no gradient to the adapters; the loader's is non-reentrant."""
    plain, plain_calls, _, _ = _one_update(tiny_model)
    w, calls, lora0, base0 = _one_update(tiny_model, **{"model.gradient_checkpointing": True})
    assert w.checkpointing and calls == 2 * plain_calls  # the attention block ran again in backward
    lora1, base1 = _split(w)
    assert all(torch.equal(base0[n], base1[n]) for n in base0)
    assert all(not torch.equal(lora0[n], lora1[n]) for n in lora0 if "lora_B" in n)  # every B left its zero init
    want = _split(plain)[0]
    for n in want:
        torch.testing.assert_close(lora1[n], want[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_train_state_is_the_adapters_and_fits_only_its_layout(tiny_model, dtype):
    """The checkpointed train state of a LoRA policy: the adapters (float32) and their optimizer state, not the
    frozen base (every worker loads it from model.path); it loads into a fresh worker, not into other targets."""
    import copy

    w, _, _, _ = _one_update(tiny_model, **{"device.dtype": dtype})
    state = copy.deepcopy(w.state_dict())
    adapters = {n for n, p in w.module.named_parameters() if p.requires_grad}
    assert set(state["model"]) == adapters and all(".lora_" in n for n in adapters)
    assert set(state["optimizer"]["state"]) == adapters
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    fresh = ActorRolloutWorker(_cfg(tiny_model, **{"device.dtype": dtype}))
    fresh.load_state_dict(state)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(fresh.master.masters, w.master.masters))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fresh.named_weights(), w.named_weights()))
    other = ActorRolloutWorker(_cfg(tiny_model, **{"device.dtype": dtype, "actor.lora_target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="another layout"):
        other.load_state_dict(state)


def test_all_linear_targets_every_linear_layer_but_the_head(tiny_model):
    """actor.lora_target_modules=[all-linear] (verl's default): attention and MLP projections, not lm_head; the
    merged weights carry the MLP's deltas too."""
    w, _, _, base0 = _one_update(tiny_model, **{"actor.lora_target_modules": ["all-linear"]})
    adapted = {n.split(".")[-4] for n, _ in w.module.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    merged = dict(w.named_weights())
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(merged[down], base0[f"base_model.model.{down[:-len('.weight')]}.base_layer.weight"])
    with pytest.raises(ValueError, match="all-linear"):
        ActorRolloutWorker(_cfg(tiny_model, **{"actor.lora_target_modules": ["qproj"]}))
