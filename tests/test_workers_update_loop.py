"""portrl.workers.update_loop on a linear model: mini-/micro-batch cutting, positions, global counts and extra
counts handed to the loss, shuffling by seed, gradient accumulation equal to one full-batch step, the schedule."""

import pytest
import torch

from portrl.workers.batch import Batch
from portrl.workers.master_weights import MasterWeights
from portrl.workers.training import build_lr_scheduler, build_optimizer
from portrl.workers.update_loop import LoopSettings, Trainable, mini_batch_rows, run_update

OPTIM = {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "scheduler": "linear",
         "warmup_steps": 0, "warmup_ratio": 0.0, "min_lr_ratio": 0.0}


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    master = MasterWeights(model)
    opt = build_optimizer(master.masters, OPTIM)
    return Trainable(model, master, opt, build_lr_scheduler(opt, OPTIM, total_steps=4), torch.device("cpu"))


def _batch(rows=6):
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(rows, 2)
    mask[0, 1] = 0
    return Batch({"x": torch.randn(rows, 3, generator=g), "y": torch.randn(rows, 1, generator=g),
                  "response_mask": mask, "attention_mask": torch.ones(rows, 2, dtype=torch.long),
                  "row": torch.arange(rows)})


def _settings(**over):
    base = dict(epochs=1, mini_rows=6, micro_rows=6, max_tokens=None, grad_clip=0.0, loss_scale_factor=2)
    return LoopSettings(**{**base, **over})


def _sum_loss(state, seen):
    def loss_fn(micro, counts, pos):
        seen.append((micro.tensors["row"].tolist(), dict(counts), pos))
        err = (state.module(micro.tensors["x"]) - micro.tensors["y"]).pow(2).sum()
        loss = err / counts["global_batch_size"]  # a sum over micro-batches gives the mini-batch mean
        return loss, {"loss": float(loss.detach()), "rows": float(len(micro))}
    return loss_fn


def test_mini_and_micro_batches_positions_and_counts():
    state, seen = _state(), []
    out = run_update(state, _batch(), _settings(epochs=2, mini_rows=3, micro_rows=2), _sum_loss(state, seen),
                     prefix="t", additive=frozenset({"loss"}), extra_counts=lambda mini: {"first_row": int(mini["row"][0])})
    assert [rows for rows, _, _ in seen] == [[0, 1], [2], [3, 4], [5]] * 2
    assert [(p.epoch, p.steps_done) for _, _, p in seen] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                             (1, 2), (1, 2), (1, 3), (1, 3)]
    assert [p.last_micro for _, _, p in seen] == [False, True] * 4  # the last before each optimizer step
    assert seen[0][1] == {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 3, "loss_scale_factor": 2,
                          "first_row": 0}
    assert seen[2][1]["batch_num_tokens"] == 6 and seen[2][1]["first_row"] == 3
    assert out["rows"] == 1.5 and out["t/grad_norm"] > 0  # "rows" averaged over micro-batches, not summed
    assert out["t/lr"] == pytest.approx(0.1 * 3 / 4) and not state.module.training
    assert state.scheduler.last_epoch == 1  # once per update, not per mini-batch


def test_accumulated_micro_batches_equal_one_step_on_the_whole_mini_batch():
    whole, split = _state(), _state()
    run_update(whole, _batch(), _settings(), _sum_loss(whole, []), prefix="t")
    seen = []
    run_update(split, _batch(), _settings(micro_rows=1), _sum_loss(split, seen), prefix="t")
    assert len(seen) == 6
    for p, q in zip(whole.module.parameters(), split.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_shuffle_by_seed_and_schedule_left_alone():
    state, seen = _state(), []
    run_update(state, _batch(), _settings(epochs=2, shuffle_seed=5), _sum_loss(state, seen), prefix="t",
               advance_schedule=False)
    for epoch, (rows, _, _) in enumerate(seen):
        assert rows == torch.randperm(6, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
    assert seen[0][0] != seen[1][0] and state.scheduler.last_epoch == 0


def test_mini_batch_rows_share_prompts_times_samples_over_ranks():
    assert mini_batch_rows(4, 2, 1) == 8 and mini_batch_rows(4, 2, 3) == 2
    with pytest.raises(ValueError, match=r"actor.ppo_mini_batch_size \* rollout.n \(2\) is smaller than the number "
                                         r"of workers \(4\)"):
        mini_batch_rows(1, 2, 4)


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _poisoned_loss(state, bad_steps, where="loss"):
    """The linear model's loss, made NaN (``where="loss"``) or given a NaN gradient (``"grad"``) on the optimizer
    steps in ``bad_steps``."""
    def loss_fn(micro, counts, pos):
        err = (state.module(micro.tensors["x"]) - micro.tensors["y"]).pow(2).sum()
        loss = err / counts["global_batch_size"]
        if pos.steps_done in bad_steps:
            if where == "loss":  # a NaN loss whose gradient is finite (the constant has none)
                loss = loss + float("nan")
            else:  # a finite loss whose gradient is NaN
                loss = _NanGrad.apply(loss)
        return loss, {"loss": float(loss.detach())}
    return loss_fn


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_non_finite_step_is_skipped_and_counted(where):
    """Mini-batch 1 of 3 (steps_done 1) has a NaN loss or gradient: its optimizer step is skipped (the weights
    and AdamW's moments and step count stay as after step 0), the others are taken, the skip is counted, and the
    schedule advances as usual."""
    state, ref = _state(), _state()
    out = run_update(state, _batch(), _settings(mini_rows=2), _poisoned_loss(state, {1}, where), prefix="t")
    assert out["t/nonfinite_skipped"] == 1.0
    assert state.scheduler.last_epoch == 1
    # the same two good steps without the bad one in between: identical weights and optimizer state
    run_update(ref, _batch().select(torch.tensor([0, 1, 4, 5])), _settings(mini_rows=2), _poisoned_loss(ref, set()),
               prefix="t")
    for p, q in zip(state.module.parameters(), ref.module.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q)
    for p, q in zip(state.master.masters, ref.master.masters):
        sp, sq = state.optimizer.state[p], ref.optimizer.state[q]
        assert float(sp["step"]) == float(sq["step"]) == 2.0
        torch.testing.assert_close(sp["exp_avg"], sq["exp_avg"])
        torch.testing.assert_close(sp["exp_avg_sq"], sq["exp_avg_sq"])
        assert p.grad is None


def test_an_update_with_every_step_non_finite_changes_nothing():
    state = _state()
    before = [p.detach().clone() for p in state.module.parameters()]
    out = run_update(state, _batch(), _settings(mini_rows=3), _poisoned_loss(state, {0, 1}), prefix="t")
    assert out["t/nonfinite_skipped"] == 2.0
    assert len(state.optimizer.state) == 2  # weight and bias: allocated up front, left at step 0
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in state.optimizer.state.values())
    assert all(torch.equal(a, b) for a, b in zip(before, state.module.parameters()))
    assert state.master.finite()
    with torch.no_grad():
        state.module.bias.fill_(float("inf"))
    assert not state.master.finite()


def test_clean_updates_report_no_skip():
    state = _state()
    assert run_update(state, _batch(), _settings(), _sum_loss(state, []), prefix="t")["t/nonfinite_skipped"] == 0.0


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_state_is_allocated_up_front_and_steps_bit_for_bit(fused):
    """build_optimizer gives every parameter its step-0 state now (so the moments are placed before the first
    rollout's buffers); three steps then equal torch's AdamW creating that state itself at its first step."""
    torch.manual_seed(0)
    built, plain = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    plain.load_state_dict(built.state_dict())
    cfg = {**OPTIM, "weight_decay": 0.1}
    opt = build_optimizer(built.parameters(), cfg, fused=fused)
    assert [sorted(opt.state[p]) for p in built.parameters()] == [["exp_avg", "exp_avg_sq", "step"]] * 2
    assert all(float(opt.state[p]["step"]) == 0 and not opt.state[p]["exp_avg"].any() for p in built.parameters())
    kind = {"fused": True} if fused else {"foreach": True}
    ref = torch.optim.AdamW(plain.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
                            weight_decay=0.1, **kind)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((built, opt), (plain, ref)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), plain.parameters()))
    assert all(float(opt.state[p]["step"]) == 3 for p in built.parameters())
