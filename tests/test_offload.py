"""The memory levers (portrl.workers.offload): state kept in host memory between the calls that read it.

Parity: a run with every lever on computes what it computes without, bit for bit (moves are exact). On the CPU
the host is the device, so the moves themselves are no-ops; what these tests hold is the bookkeeping that an
accelerator depends on: every call that reads a part (the optimizer step, the reference's forward, a checkpoint)
finds it on the device, and after the call it is back on the host.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.workers.actor import ActorRolloutWorker
from portrl.workers.offload import HOST, StateOffload, move_optimizer_state, move_tensors, saved_on_host
from _gloo_ranks import run_ranks
from _random_batch import random_rollout_batch as _batch

LEVERS = {"actor.offload.params": True, "actor.offload.optimizer": True, "actor.offload.activations": True,
          "ref.param_offload": True}


def _cfg(path, **over):
    cfg = default_config()
    base = {"device.name": "cpu", "device.num_threads": 1, "device.dtype": "bfloat16", "model.path": path,
            "rollout.n": 4, "data.max_response_length": 6, "actor.ppo_mini_batch_size": 2,
            "actor.ppo_micro_batch_size_per_device": 3, "actor.optim.lr": 1e-3, "actor.optim.eps": 1.0,
            "actor.use_kl_loss": True, "model.gradient_checkpointing": True}
    for k, v in {**base, **over}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _step_rows(worker, b):
    b = b.union(worker.compute_ref_log_probs(b))
    b = b.union(worker.compute_log_probs(b))
    return b, worker.update_actor(b)


def _step(worker, seed):
    """One step's worker calls as the trainer makes them: reference and old log-probs, then the update."""
    return _step_rows(worker, _batch(seed))


# ------------------------------------------------------------------------------------------ parts and moves
def test_parts_come_to_the_device_for_the_outermost_call_only():
    moves = []
    off = StateOffload(HOST, {"optimizer": lambda d: moves.append(("optimizer", d.type))})
    assert moves == [("optimizer", "cpu")] and not off.resident("optimizer") and off.resident("params")
    with off.on_device("optimizer", "params", "module"):  # params and module are not offloaded here
        assert off.resident("optimizer")
        with off.on_device("optimizer"):
            pass
        assert off.resident("optimizer") and len(moves) == 2  # the inner call moved nothing
    assert not off.resident("optimizer") and len(moves) == 3
    with pytest.raises(ValueError, match="unknown part 'weights'; parts are params, optimizer, reference"):
        off.add("weights", lambda d: None)


def test_module_means_params_only_where_the_module_is_made_of_them():
    for module_is_params in (True, False):
        off = StateOffload(HOST, {"params": lambda d: None}, module_is_params=module_is_params)
        with off.on_device("module"):
            assert off.resident("params") == module_is_params


def test_moves_keep_the_objects_the_optimizer_holds():
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[w].items()}
    move_tensors([w], HOST)
    move_optimizer_state(opt, HOST)
    assert opt.param_groups[0]["params"][0] is w and w.grad is not None
    assert all(torch.equal(opt.state[w][k], v) for k, v in before.items())


def test_saved_on_host_copies_activations_not_weights_and_gives_the_same_gradients():
    x = torch.randn(5, 3, requires_grad=True)
    lin = torch.nn.Linear(3, 2)
    grads = []
    for enabled in (False, True):
        x.grad = lin.weight.grad = None
        with saved_on_host(enabled, HOST):
            y = torch.tanh(lin(x))
            loss = y.pow(2).sum()
        saved = y.grad_fn._saved_result  # tanh's output, unpacked: a copy when offloaded
        assert (saved.data_ptr() != y.data_ptr()) == enabled
        addmm = y.grad_fn.next_functions[0][0]
        assert (addmm._saved_mat1.data_ptr() != x.data_ptr()) == enabled  # the input: copied
        assert addmm._saved_mat2.data_ptr() == lin.weight.data_ptr()  # the weight's transpose: as it was
        loss.backward()
        grads.append((x.grad.clone(), lin.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ----------------------------------------------------------------------------------------- one worker
def _probe(worker, seen):
    """Record, at every read of an offloaded part, whether it was on the device."""
    off = worker.offload

    def step_hook(*_):
        seen.append(("step", off.resident("params") and off.resident("optimizer")))

    worker.optimizer.register_step_pre_hook(step_hook)
    embed = worker.ref_module.get_input_embeddings()  # the log-prob op runs the model's parts, not its forward
    embed.register_forward_pre_hook(lambda *_: seen.append(("ref", off.resident("reference"))))


def test_levers_on_one_worker_give_the_same_run_bit_for_bit(tiny_model):
    plain, lean = ActorRolloutWorker(_cfg(tiny_model)), ActorRolloutWorker(_cfg(tiny_model, **LEVERS))
    assert set(lean.offload.movers) == {"params", "optimizer", "reference"} and not lean.offload.module_is_params
    lean.init_reference()
    plain.init_reference()
    seen: list = []
    _probe(lean, seen)
    for seed in (1, 2):
        b1, m1 = _step(plain, seed)
        b2, m2 = _step(lean, seed)
        for k in ("ref_log_probs", "old_log_probs"):
            assert torch.equal(b1[k], b2[k]), k
        assert m1 == m2
        assert not any(lean.offload.resident(p) for p in ("params", "optimizer", "reference"))
    assert seen and all(ok for _, ok in seen) and {k for k, _ in seen} == {"step", "ref"}
    for a, b in zip(plain.master.masters, lean.master.masters):
        assert torch.equal(a, b)
    s1, s2 = plain.state_dict(), lean.state_dict()
    assert all(torch.equal(s1["model"][k], s2["model"][k]) for k in s1["model"])
    assert all(torch.equal(v, s2["optimizer"]["state"][n][k])
               for n, st in s1["optimizer"]["state"].items() for k, v in st.items() if torch.is_tensor(v))
    resumed = ActorRolloutWorker(_cfg(tiny_model, **LEVERS))
    resumed.load_state_dict(s2)  # a resume brings the state in and sends it back out
    assert not resumed.offload.resident("optimizer") and resumed.optimizer.state


def test_a_float32_run_without_fsdp_has_no_params_to_offload(tiny_model):
    w = ActorRolloutWorker(_cfg(tiny_model, **{"device.dtype": "float32", "actor.offload.params": True}))
    assert "params" not in w.offload.movers  # its float32 module is the engine's and the update's at once


# ------------------------------------------------------------------------------------------ FSDP2, two ranks
def _fsdp_rank(rank, world, path):
    out = {}
    for name, over in (("plain", {}), ("lean", LEVERS)):
        worker = ActorRolloutWorker(_cfg(path, **over), rank=rank, world_size=world)
        assert worker.strategy == "fsdp"
        worker.init_reference()
        b = _batch(3)
        rows = torch.arange(len(b))[rank::world]
        _, metrics = _step_rows(worker, b.select(rows))
        out[name] = (metrics, worker.offload.module_is_params, {k: v for k, v in worker.state_dict()["model"].items()})
    return out


def test_levers_under_fsdp2_give_the_same_update(tiny_model):
    for rank, got in run_ranks(_fsdp_rank, 2, (tiny_model,)).items():
        (m1, _, s1), (m2, module_is_params, s2) = got["plain"], got["lean"]
        assert module_is_params  # FSDP2's shards are the params part
        assert m1 == m2, rank
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
