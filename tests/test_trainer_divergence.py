"""A run that diverges stops cleanly (portrl.trainer.divergence): steps whose loss is not finite skip their update
(weights and optimizer state unchanged, counted), ``trainer.max_nonfinite_steps`` of them in a row stop the run with
one line naming the last good checkpoint (exit code 2), the checkpoints of the diverged weights are set aside so that
``trainer.resume=auto`` continues from the good one, no checkpoint is written from non-finite weights, and a policy
whose logits are not finite (lr=1e20) stops the run the same way instead of failing with an index error."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from portrl.config.options_schema import default_config
from portrl.errors import UserError
from portrl.trainer.divergence import DivergenceWatch, TrainingDiverged


BASE = {"device.name": "cpu", "device.num_threads": 1, "data.arith.num_train": 64, "data.arith.num_test": 8,
        "data.train_batch_size": 4, "data.max_response_length": 5, "rollout.n": 4, "actor.ppo_mini_batch_size": 4,
        "actor.optim.lr": 1e-3, "trainer.test_freq": 0, "trainer.val_before_train": False,
        "trainer.progress_bar": False, "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": False,
        "trainer.save_final": False, "trainer.save_freq": 1, "trainer.max_ckpt_to_keep": 5,
        "model.sft_warm_start": False}


def _cfg(model, out, **over):
    cfg = default_config()
    for k, v in {**BASE, "model.path": model, "trainer.output_dir": str(out), **over}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _argv(model, out, **over):
    return ["train"] + [f"{k}={json.dumps(v) if isinstance(v, list) else v}"
                        for k, v in {**BASE, "model.path": model, "trainer.output_dir": str(out), **over}.items()]


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _actor(ckpt):
    return load_file(str(ckpt / "actor.safetensors"))


def _nan_loss_from(monkeypatch, first_update, last_update=10**9):
    """The actor's loss is NaN in its updates ``first_update`` .. ``last_update`` (0-based); its gradient stays
    finite. Returns
    the list that gets, after each update, the weights and AdamW states (copies)."""
    import portrl.workers.actor as actor_mod

    real = actor_mod.actor_loss
    calls = {"updates": 0}
    real_update = actor_mod.ActorRolloutWorker.update_actor
    after: list = []

    def update_actor(self, batch):
        try:
            return real_update(self, batch)
        finally:
            calls["updates"] += 1
            opt = self.optimizer.state
            after.append(([m.detach().clone() for m in self.master.masters],
                          [{k: v.clone() for k, v in opt[m].items()} for m in self.master.masters if m in opt]))

    def loss(*args, **kwargs):
        value, metrics = real(*args, **kwargs)
        return (value + float("nan") if first_update <= calls["updates"] <= last_update else value), metrics

    monkeypatch.setattr(actor_mod, "actor_loss", loss)
    monkeypatch.setattr(actor_mod.ActorRolloutWorker, "update_actor", update_actor)
    return after


def test_steps_in_a_row_with_a_non_finite_loss_stop_the_run_and_it_resumes_from_the_good_checkpoint(
        tiny_model, tmp_path, monkeypatch, capsys):
    from portrl.cli import main

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    after = _nan_loss_from(monkeypatch, 2)  # steps 1 and 2 train; 3 and 4 have a NaN loss
    over = {"trainer.total_steps": 6, "trainer.max_nonfinite_steps": 2, "trainer.max_ckpt_to_keep": 2}
    rc = main(_argv(tiny_model, out, **over))
    err = capsys.readouterr().err.strip().splitlines()
    ckpts = out / "checkpoints"
    assert rc == 2 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"portrl train: error: training diverged: steps 3-4 in a row had a non-finite loss or gradient "
                       f"norm (actor), so their updates were skipped (trainer.max_nonfinite_steps=2); last good "
                       f"checkpoint: {ckpts / 'global_step_1'} (global_step_2.diverged holds the diverged weights); "
                       f"lower actor.optim.lr and resume from it (trainer.resume=auto)")
    # step 2's weights gave the NaN losses: its checkpoint is set aside; the checkpoints of steps 3 and 4 (skipped
    # updates) were put off, so rotation (max 2) kept step 1's
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("global")) == \
        ["global_step_1", "global_step_2.diverged"]
    # the skipped updates changed no weight, no AdamW moment and no step count
    assert len(after) == 4 and not all(torch.equal(a, b) for a, b in zip(after[0][0], after[1][0]))
    for skipped in after[2:]:
        assert all(torch.equal(a, b) for a, b in zip(after[1][0], skipped[0]))
        assert len(skipped[1]) == len(after[1][1]) > 0
        assert all(torch.equal(s1[k], s2[k]) for s1, s2 in zip(after[1][1], skipped[1]) for k in s1)
    rows = {r["step"]: r for r in _rows(out)}
    assert sorted(rows) == [1, 2, 3, 4]  # the metrics of every finished step are written
    assert [rows[s]["actor/nonfinite_skipped"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [rows[s]["actor/nonfinite_skipped_total"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 2.0]
    assert [rows[s]["train/nonfinite_streak"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 2.0]

    monkeypatch.undo()  # the loss is finite again (as after a lower learning rate): the relaunch resumes and finishes
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    assert main(_argv(tiny_model, out, **over)) == 0
    assert f"resumed from       {ckpts / 'global_step_1'}" in capsys.readouterr().out
    rows = {r["step"]: r for r in _rows(out)}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6] and all(rows[k]["actor/nonfinite_skipped"] == 0.0 for k in rows)


def test_a_checkpoint_due_at_a_skipped_step_is_written_at_the_next_clean_one(tiny_model, tmp_path, monkeypatch,
                                                                                 caplog):
    """One step with a NaN loss (step 2) is skipped and the run goes on; its due checkpoint (save_freq=2) waits for
    step 3, whose update is taken."""
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    _nan_loss_from(monkeypatch, 1, 1)
    out = tmp_path / "run"
    s = run_training(_cfg(tiny_model, out, **{"trainer.total_steps": 4, "trainer.save_freq": 2}))
    assert s["steps"] == 4 and "checkpoint of step 2 put off: its update was skipped" in caplog.text
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("global")) == \
        ["global_step_3", "global_step_4"]
    assert [r["train/nonfinite_streak"] for r in _rows(out)] == [0.0, 1.0, 0.0, 0.0]


def test_non_finite_weights_are_never_saved_and_their_logits_stop_the_run(tiny_model, tmp_path, monkeypatch, caplog):
    """Step 2's update leaves an infinite weight: its checkpoint is not written (a warning), step 3's rollout gets
    non-finite logits and the run stops naming step 1's checkpoint."""
    import portrl.workers.actor as actor_mod
    from portrl.trainer import run_training

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    real_update = actor_mod.ActorRolloutWorker.update_actor

    def update_actor(self, batch):
        out = real_update(self, batch)
        if self.update_count == 2:
            with torch.no_grad():
                self.master.masters[0].fill_(float("inf"))
                self.master.masters_to_params()
        return out

    monkeypatch.setattr(actor_mod.ActorRolloutWorker, "update_actor", update_actor)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as err:
        run_training(_cfg(tiny_model, out, **{"trainer.total_steps": 4}))
    assert isinstance(err.value, UserError)
    ckpts = out / "checkpoints"
    assert str(err.value) == (f"training diverged: the policy's logits are not finite (NaN or inf at decode step 0) "
                              f"with the weights after step 2's update; last good checkpoint: "
                              f"{ckpts / 'global_step_1'}; lower actor.optim.lr and resume from it "
                              f"(trainer.resume=auto)")
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("global")) == ["global_step_1"]
    assert "no checkpoint of step 2: the actor weights are not finite" in caplog.text
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_a_huge_learning_rate_stops_the_run_on_its_first_diverged_rollout(tiny_model, tmp_path, monkeypatch, capsys):
    """The issue's reproduction, actor.optim.lr=1e20 (GRPO's preset: a KL loss, weight decay): step 1's loss is
    finite, its update leaves finite but huge weights whose forward overflows; step 2's rollout stops the run in one
    line (before: `index 272 is out of bounds`, at every relaunch), and step 1's checkpoint, written from those weights,
    is set aside so that a relaunch with a lower learning rate starts over instead of dying the same way."""
    from portrl.cli import main

    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(_argv(tiny_model, out, **{"trainer.total_steps": 3, "actor.optim.lr": 1e20})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("portrl train: error: training diverged: the policy's logits are not finite (NaN or inf at "
                       "decode step 0) with the weights after step 1's update; last good checkpoint: none "
                       "(global_step_1.diverged holds the diverged weights); lower actor.optim.lr and start again "
                       "(trainer.resume=auto starts over when there is no checkpoint)")
    weights = _actor(out / "checkpoints" / "global_step_1.diverged")  # finite, huge: the forward overflows
    assert all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())
    assert main(_argv(tiny_model, out, **{"trainer.total_steps": 2})) == 0  # lr 1e-3: starts over, runs through
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_the_watch_counts_streaks_and_carries_a_resumed_runs_counts():
    earlier = [{"step": 0}, {"step": 1, "actor/nonfinite_skipped": 0.0},
               {"step": 2, "actor/nonfinite_skipped": 2.0, "critic/nonfinite_skipped": 0.0}]
    w = DivergenceWatch(3, earlier)
    assert w.observe(3, {"train/skipped": 1.0}) == {"actor/nonfinite_skipped_total": 2.0,
                                                    "critic/nonfinite_skipped_total": 0.0,
                                                    "train/nonfinite_streak": 1.0}  # no update: the streak stays
    step4 = w.observe(4, {"critic/nonfinite_skipped": 1.0, "actor/nonfinite_skipped": 0.0})
    assert step4["train/nonfinite_streak"] == 2
    assert not w.diverged
    w.observe(5, {"actor/nonfinite_skipped": 1.0})
    assert w.diverged and w.streak == [2, 4, 5] and w.roles == ["actor", "critic"]
    assert "steps 2-5 in a row had a non-finite loss or gradient norm (actor, critic)" in str(w.stop(None))
    w.observe(6, {"actor/nonfinite_skipped": 0.0})
    assert not w.diverged and w.totals == {"actor": 3.0, "critic": 1.0}
    never = DivergenceWatch(0)
    for step in range(1, 10):
        never.observe(step, {"actor/nonfinite_skipped": 1.0})
    assert not never.diverged
