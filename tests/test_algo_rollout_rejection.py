"""Rollout correction beyond the IS weights (portrl.algo.rollout_correction): rejection sampling at token, sequence
and geometric level and the token veto against hand-computed masks; the actor's update with rejection equals the
update on the hand-masked response mask; the ``rollout_corr/*`` metrics by hand, combined over micro-batches;
decoupled PPO (clip on pi / pi_old times the truncated behaviour weight) by hand; a bad bound is one line with
exit code 2; two training steps with ``rollout_rs=token`` log the metrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from portrl.algo.objectives import policy_gradient_loss
from portrl.algo.rollout_correction import correction_metrics, correction_stats, rejection_mask
from portrl.cli import main
from portrl.workers.batch import Batch
from portrl.workers.training import rollout_corr_metrics

# log rho = old - rollout: row 0 [0.5, -1.0, 0.0]; row 1 [0.0, -2.8, pad (a huge gap there must not count)]
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -30.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_rejection_by_hand():
    # bounds [1/1.5, 1.5] = log [-0.405, 0.405]: 0.5 and -1.0 and -2.8 are outside
    got = rejection_mask(OLD, ROLLOUT, MASK, "token", 1.5)
    assert got.tolist() == [[0, 0, 1], [1, 0, 0]] and got.dtype == MASK.dtype
    # an explicit lower bound 0.3 (log -1.204) keeps -1.0; upper 2 (log 0.693) keeps 0.5
    assert rejection_mask(OLD, ROLLOUT, MASK, "token", 2.0, 0.3).tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.equal(rejection_mask(OLD, ROLLOUT, MASK), MASK)  # nothing set: nothing rejected


def test_sequence_and_geometric_rejection_by_hand():
    # products: row 0 e^-0.5 = 0.607, row 1 e^-2.8 = 0.061; geometric means: e^(-0.5/3) = 0.846, e^(-2.8/2) = 0.247
    assert rejection_mask(OLD, ROLLOUT, MASK, "sequence", 2.0).tolist() == [[1, 1, 1], [0, 0, 0]]
    assert rejection_mask(OLD, ROLLOUT, MASK, "sequence", 1.5).tolist() == [[0, 0, 0], [0, 0, 0]]  # 0.607 < 0.667
    assert rejection_mask(OLD, ROLLOUT, MASK, "geometric", 1.5).tolist() == [[1, 1, 1], [0, 0, 0]]  # 0.846 kept
    assert rejection_mask(OLD, ROLLOUT, MASK, "geometric", 1.1).tolist() == [[0, 0, 0], [0, 0, 0]]  # 0.846 < 0.909
    assert rejection_mask(OLD, ROLLOUT, MASK, "geometric", 4.0, 0.2).tolist() == [[1, 1, 1], [1, 1, 0]]


def test_veto_rejects_whole_sequences():
    # a token ratio below 0.1 (log -2.303): row 1's -2.8; row 0's lowest is -1.0; row 1's padding does not count
    assert rejection_mask(OLD, ROLLOUT, MASK, veto_threshold=0.1).tolist() == [[1, 1, 1], [0, 0, 0]]
    assert rejection_mask(OLD, ROLLOUT, MASK, veto_threshold=0.01).tolist() == [[1, 1, 1], [1, 1, 0]]
    # veto and bounds together: token bounds [0.3, 2] reject row 1's second token, the veto row 1 as a whole
    assert rejection_mask(OLD, ROLLOUT, MASK, "token", 2.0, 0.3, veto_threshold=0.1).tolist() == [[1, 1, 1], [0, 0, 0]]


def test_bad_levels_and_bounds():
    with pytest.raises(ValueError, match="rollout_rs level 'seq' is unknown"):
        rejection_mask(OLD, ROLLOUT, MASK, "seq", 2.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold must be > 0"):
        rejection_mask(OLD, ROLLOUT, MASK, "token", None)
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower must be in"):
        rejection_mask(OLD, ROLLOUT, MASK, "token", 0.5)  # default lower 2 > upper 0.5
    with pytest.raises(ValueError, match="rollout_token_veto_threshold must be > 0"):
        rejection_mask(OLD, ROLLOUT, MASK, veto_threshold=0.0)


def test_metrics_by_hand_and_summed_over_pieces():
    kept = rejection_mask(OLD, ROLLOUT, MASK, "token", 1.5)
    m = correction_metrics(correction_stats(OLD, ROLLOUT, MASK, kept, "token", 1.5, veto_threshold=0.1))
    w = [math.exp(0.5), math.exp(-1.0), 1.0, 1.0, math.exp(-2.8)]  # token weights on the 5 response tokens
    mean = sum(w) / 5
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(mean)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(sum(x * x for x in w) / 5 - mean ** 2))
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-2.8))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.5))
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # e^0.5 > 1.5
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5)  # e^-1, e^-2.8 < 1/1.5
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    d = [0.5, -1.0, 0.0, 0.0, -2.8]  # log rho
    assert m["rollout_corr/kl"] == pytest.approx(-sum(d) / 5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5)
    # sequence level: each token carries its row's product e^-0.5 / e^-2.8
    seq = correction_metrics(correction_stats(OLD, ROLLOUT, MASK, MASK, "sequence", 2.0))
    assert seq["rollout_corr/rollout_is_mean"] == pytest.approx((3 * math.exp(-0.5) + 2 * math.exp(-2.8)) / 5)
    assert seq["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and seq["rollout_corr/rollout_is_veto_fraction"] == 0
    # the same numbers from the rows one at a time (micro-batches, or ranks), combined as the actor does
    parts = [correction_stats(OLD[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1], kept[i:i + 1], "token", 1.5, 0.1)
             for i in range(2)]
    assert rollout_corr_metrics(parts, world_size=1) == pytest.approx(m)
    assert correction_metrics(correction_stats(OLD, ROLLOUT, MASK * 0, MASK * 0)) == {}


def _loss_cfg(**rc):
    from portrl.config.options_schema import default_config

    cfg = default_config()
    for k, v in rc.items():
        OmegaConf.update(cfg, f"algorithm.rollout_correction.{k}", v)
    return cfg


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_ppo_by_hand(level):
    """The rollout_is path with the vanilla loss is decoupled PPO: per token
    ``max(-A r, -A clip(r, 0.8, 1.2)) * min(pi_old / pi_rollout, 2)`` with ``r = pi / pi_old``, token-mean."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])
    logp = old + torch.tensor([[0.1, -0.4, 0.0], [0.3, 0.05, 0.0]])  # r = e^0.1, e^-0.4, 1; e^0.3, e^0.05
    behav = old - torch.tensor([[0.2, 1.0, -0.5], [0.0, -0.1, 0.0]])  # log(pi_old / pi_rollout) = these
    adv = torch.tensor([[1.0, -0.5, 2.0], [0.7, -1.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cfg = _loss_cfg(rollout_is=level, rollout_is_threshold=2.0)
    tensors = {"response_mask": mask, "advantages": adv, "rollout_log_probs": behav}
    info = {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2, "loss_scale_factor": 3}
    loss, metrics = policy_gradient_loss(cfg.actor, cfg.algorithm, tensors, logp, old, info)
    logw = [[0.2, 1.0, -0.5], [0.0, -0.1]]
    if level == "sequence":
        logw = [[sum(row)] * len(row) for row in logw]
    want = 0.0
    for i, row in enumerate(logw):
        for t, lw in enumerate(row):
            a, r = float(adv[i, t]), math.exp(float(logp[i, t] - old[i, t]))
            want += max(-a * r, -a * min(max(r, 0.8), 1.2)) * min(math.exp(lw), 2.0)
    assert loss.item() == pytest.approx(want / 5, rel=1e-6)
    assert "rollout_corr/is_weight_mean" in metrics


# ------------------------------------------------------------------------------------------ the actor's update
def _actor(path, **over):
    from portrl.config.options_schema import default_config
    from portrl.workers.actor import ActorRolloutWorker

    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
                 "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4, "actor.optim.lr": 5e-2,
                 "actor.ppo_micro_batch_size_per_device": 4, **over}.items():
        OmegaConf.update(cfg, k, v)
    return ActorRolloutWorker(cfg)


def _weights(worker):
    return torch.cat([p.detach().flatten() for p in worker.module.parameters()])


def _bumped_batch(tiny_model) -> Batch:
    """16 sampled rows with the trainer's ``old_log_probs``, random advantages, and rollout log-probs equal to the
    trainer's except on each row's first response token, where the rollout policy is e times likelier."""
    gen = _actor(tiny_model)
    prompts = [gen.tokenizer(f"{i}+{i}=")["input_ids"] for i in range(4)]
    batch = gen.generate(prompts, {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 1},
                         meta={"uid": [f"p{i}" for i in range(4)]})
    batch = batch.union(gen.compute_log_probs(batch))
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0)) \
        * batch["response_mask"]
    bump = torch.zeros_like(batch["old_log_probs"])
    bump[:, 0] = 1.0
    batch["rollout_log_probs"] = batch["old_log_probs"] + bump
    del gen
    return batch


def test_the_update_with_rejection_is_the_update_on_the_masked_mask(tiny_model):
    """Ratio e^-1 < 1/2 on each row's first response token: ``rollout_rs=token`` at 2 rejects exactly those 16."""
    batch = _bumped_batch(tiny_model)
    bump = torch.zeros_like(batch["old_log_probs"])
    bump[:, 0] = 1.0
    rs = {"algorithm.rollout_correction.rollout_rs": "token", "algorithm.rollout_correction.rollout_rs_threshold": 2.0}
    a = _actor(tiny_model, **rs)
    m = a.update_actor(batch)
    hand = Batch(batch.tensors, batch.meta, batch.info)
    hand["response_mask"] = batch["response_mask"] * (1 - bump).to(batch["response_mask"].dtype)
    b = _actor(tiny_model)
    b.update_actor(hand)
    assert torch.equal(_weights(a), _weights(b))  # the same update as on the hand-masked response mask
    c = _actor(tiny_model)
    c.update_actor(batch)
    assert not torch.equal(_weights(a), _weights(c))  # and masking changed it
    n = float(batch["response_mask"].sum())
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(16 / n)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-1.0), rel=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.0, rel=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((n - 16 + 16 * math.exp(-1.0)) / n, rel=1e-5)
    assert m["rollout_corr/kl"] == pytest.approx(16 / n, rel=1e-5)
    # the gap metrics still cover every response token (before rejection): 16 tokens at 1.0, the rest at 0
    assert m["training/rollout_log_probs_diff_mean"] == pytest.approx(16 / n, rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_by_hand(level):
    from portrl.workers.actor_correction import normalize_is_weights

    cfg = _loss_cfg(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    batch = Batch({"old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "response_mask": MASK})
    out, metrics = normalize_is_weights(cfg, batch, world_size=1)
    if level == "token":  # min(rho, 2) on the 5 response tokens, and their mean
        w = torch.tensor([[min(math.exp(0.5), 2.0), math.exp(-1.0), 1.0], [1.0, math.exp(-2.8), 0.0]],
                         dtype=torch.float64)
        mean = float(w.sum()) / 5
    else:  # one weight per response, e^-0.5 and e^-2.8, and their mean over the 2 responses
        w = torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-2.8)] * 2 + [0.0]], dtype=torch.float64)
        mean = (math.exp(-0.5) + math.exp(-2.8)) / 2
    assert metrics == {"rollout_corr/rollout_is_batch_norm_factor": pytest.approx(mean)}
    torch.testing.assert_close(out["rollout_is_weights"].double(), w / mean, rtol=1e-6, atol=1e-7)
    assert "rollout_is_weights" not in batch  # the caller's batch is left as it was
    off, none = normalize_is_weights(_loss_cfg(rollout_is=level), batch, world_size=1)
    assert off is batch and none == {}


def test_the_update_with_batch_normalised_weights_uses_them(tiny_model):
    """``rollout_is_batch_normalize``: the update equals one whose batch carries the hand-normalised weights."""
    batch = _bumped_batch(tiny_model)
    n = float(batch["response_mask"].sum())
    factor = (n - 16 + 16 * math.exp(-1.0)) / n  # 16 tokens at e^-1, the others at 1
    a = _actor(tiny_model, **{"algorithm.rollout_correction.rollout_is": "token",
                              "algorithm.rollout_correction.rollout_is_batch_normalize": True})
    m = a.update_actor(batch)
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-6)
    hand = Batch(batch.tensors, batch.meta, batch.info)
    w = torch.ones_like(batch["old_log_probs"])
    w[:, 0] = math.exp(-1.0)
    hand["rollout_is_weights"] = w * batch["response_mask"] / factor
    b = _actor(tiny_model)
    b.update_actor(hand)
    torch.testing.assert_close(_weights(a), _weights(b), rtol=1e-5, atol=1e-6)
    c = _actor(tiny_model)
    c.update_actor(batch)
    assert (_weights(a) - _weights(c)).abs().max() > 1e-4  # the weights changed the update


# ----------------------------------------------------------------------------------------------- the CLI
SMALL = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
         "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.arith.num_train=64", "data.arith.num_test=8",
         "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.max_response_length=4",
         "trainer.progress_bar=false", "trainer.total_steps=2", "trainer.test_freq=0",
         "trainer.val_before_train=false", "model.sft_warm_start=false", "trainer.export_hf=false",
         "trainer.plot=false"]
RC = "algorithm.rollout_correction."


@pytest.mark.parametrize("over, message", [
    ([f"{RC}rollout_rs=token", f"{RC}rollout_rs_threshold=0.5"],
     f"{RC}rollout_rs_threshold=0.5 must be >= 1 when rollout_rs_threshold_lower is null"),
    ([f"{RC}rollout_rs=token"], f"{RC}rollout_rs_threshold=None must be set, > 0"),
    ([f"{RC}rollout_rs=geometric", f"{RC}rollout_rs_threshold=1.01", f"{RC}rollout_rs_threshold_lower=1.5"],
     f"{RC}rollout_rs_threshold_lower=1.5 must be in (0, rollout_rs_threshold=1.01]"),
    ([f"{RC}rollout_token_veto_threshold=-1"], f"{RC}rollout_token_veto_threshold=-1.0 must be > 0"),
    ([f"{RC}rollout_rs=tok"], f"{RC}rollout_rs='tok' is not one of None, 'token', 'sequence', 'geometric'"),
    ([f"{RC}rollout_rs_threshold=2"], f"{RC}rollout_rs_threshold=2.0 only applies with {RC}rollout_rs set"),
    ([f"{RC}rollout_rs=token", f"{RC}rollout_rs_threshold=2", f"{RC}bypass_mode=true"], "set " + RC + "bypass_mode=false"),
    ([f"{RC}rollout_is_batch_normalize=true"], f"{RC}rollout_is_batch_normalize=true normalises the IS weights of "
                                               f"decoupled mode: set {RC}rollout_is"),
])
def test_a_bad_bound_is_one_line(over, message, tmp_path, monkeypatch, capsys):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model load was reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PORTRL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMALL, *over]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if " WARNING " not in line]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_two_steps_with_token_rejection_log_the_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--log-level", "WARNING", "train", *SMALL, f"{RC}rollout_rs=token", f"{RC}rollout_rs_threshold=2.0",
            f"trainer.output_dir={out}"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "timing_s/old_log_prob" in r  # rejection needs the proximal policy before the update
        # the hf engine shares the trainer's module: ratios are 1 up to float noise, nothing is rejected
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert r["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        for key in ("rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_rs_seq_masked_fraction", "kl"):
            assert math.isfinite(r[f"rollout_corr/{key}"])
