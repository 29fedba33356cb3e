"""bfloat16 training keeps float32 master weights and optimizer state (portrl.workers.master_weights).

The defect this guards against: AdamW stepping bfloat16 parameters in place moves almost no weight at a
small learning rate (an update of ~lr is below half a bfloat16 spacing). With masters every weight moves in
float32 and the compute copy is its rounding; checkpoints carry the float32 masters.
"""

import torch
from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.workers.actor import ActorRolloutWorker
from portrl.workers.master_weights import MasterWeights, load_dtype
from portrl.workers.training import clip_and_step


def _holder(p):
    m = torch.nn.Module()
    m.w = p
    return m


def _steps(params, optimizer, master, n=5):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if master is None:
            optimizer.step()
        else:
            clip_and_step(optimizer, master, 0.0)


def _moved(before, after):
    return float((before != after).float().mean())


def test_small_lr_moves_every_master_weight():
    torch.manual_seed(0)
    w0 = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    # the defect, measured: AdamW on the bfloat16 parameter itself at lr 1e-6 leaves nearly all of it unchanged
    plain = torch.nn.Parameter(w0.clone())
    _steps([plain], torch.optim.AdamW([plain], lr=1e-6, weight_decay=0.0), None)
    assert _moved(w0, plain.detach()) < 0.1
    # with masters: every float32 master moves by ~5 * lr, and the bfloat16 weight is its rounding
    p = torch.nn.Parameter(w0.clone())
    master = MasterWeights(_holder(p))
    assert master.active and master.masters[0].dtype == torch.float32
    opt = torch.optim.AdamW(master.masters, lr=1e-6, weight_decay=0.0)
    _steps([p], opt, master)
    m = master.masters[0].detach()
    assert _moved(w0.float(), m) > 0.99
    assert (m - w0.float()).abs().max() < 1e-5
    assert torch.equal(p.detach(), m.to(torch.bfloat16))
    assert all(s.dtype == torch.float32 for s in opt.state[master.masters[0]].values() if s.dim() > 0)


def test_float32_parameters_are_their_own_masters():
    p = torch.nn.Parameter(torch.zeros(3))
    master = MasterWeights(_holder(p))
    assert not master.active and master.masters[0] is p


def test_masters_start_from_the_float32_load_then_the_module_computes_in_bf16():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    lin.register_buffer("freq", torch.rand(4))  # a float32 buffer (rotary frequencies) stays float32
    full = lin.weight.detach().clone()
    master = MasterWeights(lin, "bfloat16")
    assert master.active and lin.weight.dtype == torch.bfloat16 and lin.freq.dtype == torch.float32
    assert torch.equal(master.masters[master.names.index("weight")].detach(), full)  # not the bf16 rounding
    assert master.params[master.names.index("weight")] is lin.weight  # the Parameter objects are kept
    assert load_dtype("bfloat16") == "float32" and load_dtype("float32") == "float32"


def _cfg(path):
    cfg = default_config()
    cfg.device.name = "cpu"
    cfg.device.num_threads = 1
    cfg.device.dtype = "bfloat16"
    cfg.model.path = path
    for k, v in {"rollout.n": 4, "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4,
                 "actor.optim.lr": 1e-6, "actor.optim.weight_decay": 0.0}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _rollout(worker):
    prompts = [worker.tokenizer(f"{i}+{i}=")["input_ids"] for i in range(4)]
    b = worker.generate(prompts, {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 1},
                        meta={"uid": [f"p{i}" for i in range(4)]})
    b["advantages"] = torch.randn(b["response_mask"].shape, generator=torch.Generator().manual_seed(0)) \
        * b["response_mask"]
    return b


def test_bf16_actor_update_and_checkpoint(tiny_model):
    cfg = _cfg(tiny_model)
    a = ActorRolloutWorker(cfg)
    assert next(a.module.parameters()).dtype == torch.bfloat16 and a.master.active
    # the masters hold the checkpoint's float32 values, not their bfloat16 rounding
    from safetensors.torch import load_file

    saved = load_file(f"{tiny_model}/model.safetensors")
    for n, m in zip(a.master.names, a.master.masters):
        assert torch.equal(m.detach(), saved[n]), n
    before = {n: m.detach().clone() for n, m in zip(a.master.names, a.master.masters)}
    batch = _rollout(a)
    a.update_actor(batch)
    moved = sum(int((before[n] != m.detach()).sum()) for n, m in zip(a.master.names, a.master.masters))
    total = sum(m.numel() for m in a.master.masters)
    assert moved / total > 0.9, f"only {moved}/{total} float32 master weights changed at lr 1e-6"
    for p, m in zip(a.master.params, a.master.masters):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))

    state = a.state_dict()
    assert all(state["model"][n].dtype == torch.float32 for n in a.master.names)  # the masters, not the rounding
    assert set(state["optimizer"]["state"]) <= set(a.master.names)  # keyed by parameter name
    b = ActorRolloutWorker(cfg)
    b.load_state_dict(state)
    for ma, mb in zip(a.master.masters, b.master.masters):
        assert torch.equal(ma.detach(), mb.detach())
        sa, sb = a.optimizer.state[ma], b.optimizer.state[mb]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the resumed worker continues as the original (to float32 summation order)
    batch2 = _rollout(a)
    a.update_actor(batch2)
    b.update_actor(batch2)
    for ma, mb in zip(a.master.masters, b.master.masters):
        assert torch.allclose(ma.detach(), mb.detach(), atol=1e-6, rtol=0)
