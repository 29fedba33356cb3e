"""Training honours the response mask of multi-turn rollouts (issue 36, item 4) and per-turn rewards.

A hand-built batch of trajectories (two-turn ones with tool tokens between the turns, single-turn ones, padding)
goes through the entry points the trainer uses (the actor's loss, the advantage phase, the critic's value loss,
the step metrics, the reward scorer). Every result on the model's tokens equals the same computation on the
batch with the tool tokens removed; the tool tokens get zero advantages, rewards and gradients. The tool
positions hold values that would change every result if they leaked (rollout log-prob 0 against an old
log-prob of -25, advantages of 50, ...).
"""

from __future__ import annotations

import copy

import pytest
import torch

from portrl.agent.trajectory import META_NUM_TURNS, META_TURN_ENDS, META_TURN_REWARDS, Trajectory
from portrl.algo import compute_value_loss, get_kl_controller
from portrl.config.composition import compose
from portrl.models.tokenizer import build_char_tokenizer
from portrl.rewards.manager import place_turn_rewards, turn_extra_infos
from portrl.trainer.advantage_phase import apply_reward_kl, compute_batch_advantages
from portrl.trainer.metrics import data_metrics
from portrl.trainer.reward_scoring import RewardScorer, decode_responses
from portrl.workers.actor_loss import actor_loss
from portrl.workers.batch import Batch, build_rollout_batch, response_lengths, response_valid_mask
from portrl.workers.training import global_counts

LOSS_SCALE = 8  # data.max_response_length: the seq-mean-token-sum-norm constant, the same for both batches


def trajectories() -> list:
    """Rows 0, 2: model turn, tool turn, model turn; rows 1, 3: one model turn. Groups (uid): rows 0-1, 2-3."""
    turns = [[(1, [10, 11, 12]), (0, [20, 21]), (1, [13, 14])],
             [(1, [15, 16, 17, 18])],
             [(1, [30, 31]), (0, [40, 41, 42]), (1, [32, 33, 34])],
             [(1, [35, 36, 37, 38, 39])]]
    out = []
    for row in turns:
        t = Trajectory(prompt_ids=[1, 2, 3])
        for model, ids in row:
            if model:
                t.add_model_tokens(ids, [-0.5] * len(ids))
            else:
                t.add_context_tokens(ids)
        t.check()
        out.append(t)
    return out


def rollout(trajs: list) -> Batch:
    """The rollout Batch of ``trajs`` (response_mask 0 on tool tokens) with the multi-turn meta."""
    batch = build_rollout_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                                [t.logprobs for t in trajs],
                                meta={"uid": ["a", "a", "b", "b"], META_NUM_TURNS: [t.num_turns for t in trajs],
                                      META_TURN_ENDS: [t.turn_ends for t in trajs],
                                      META_TURN_REWARDS: [t.turn_rewards for t in trajs]})
    mask = torch.zeros_like(batch.tensors["response_mask"])
    for i, t in enumerate(trajs):
        mask[i, :len(t.response_mask)] = torch.tensor(t.response_mask)
    batch["response_mask"] = mask
    return batch


BATCH = rollout(trajectories())
M = BATCH.tensors["response_mask"].bool()
TOOL = response_valid_mask(BATCH).bool() & ~M  # tool tokens: valid, not the model's
W = int(M.sum(-1).max())  # the width of the batch without tool tokens


def compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` at the model's tokens only, left-aligned in a (B, W) tensor, zero-padded."""
    out = torch.zeros((x.shape[0], W), dtype=x.dtype)
    for i in range(x.shape[0]):
        v = x[i][M[i]]
        out[i, :v.numel()] = v
    return out


CM = compact(M.long()).bool()  # the response mask of the batch without tool tokens


def per_token(seed: int, tool_value: float) -> torch.Tensor:
    """A random (B, T) float64 tensor with ``tool_value`` on the tool tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M.shape, generator=g, dtype=torch.float64)
    return torch.where(TOOL, torch.full_like(x, tool_value), x)


@pytest.fixture(scope="module")
def base_cfg():
    return compose(device="cpu", overrides=["algorithm=ppo"])


def cfg_with(base, **sections):
    """A copy of ``base`` with ``{"actor.loss_agg_mode": ..., ...}`` set (underscores for dots: ``actor__x``)."""
    cfg = copy.deepcopy(base)
    for key, value in sections.items():
        *path, last = key.split("__")
        node = cfg
        for p in path:
            node = node[p]
        node[last] = value
    return cfg


def test_batch_layout_and_lengths():
    assert M.sum().item() == 19 and TOOL.sum().item() == 5
    assert response_lengths(BATCH).tolist() == [7, 4, 8, 5]  # all valid tokens, tool tokens too
    assert torch.equal(response_valid_mask(BATCH), BATCH.tensors["attention_mask"][:, -8:])
    assert BATCH.meta[META_TURN_ENDS] == [[2, 6], [3], [1, 7], [4]]
    no_attention = Batch({k: BATCH.tensors[k] for k in ("responses", "response_mask")})
    assert torch.equal(response_valid_mask(no_attention), BATCH.tensors["response_mask"])  # the fallback


def test_turn_extra_infos_copies():
    rows = [{"a": 1}, None, "text"]
    out = turn_extra_infos(rows, [2, 1, 3], [[0.5, 0], [1], [0, 0, 0]])
    assert out == [{"a": 1, "num_turns": 2, "turn_rewards": [0.5, 0.0]}, {"num_turns": 1, "turn_rewards": [1.0]},
                   "text"]
    assert rows[0] == {"a": 1} and out[0] is not rows[0]
    assert turn_extra_infos(rows, None, None) == rows  # a single-turn batch: unchanged


def run_actor_loss(cfg, mask: torch.Tensor, t: dict):
    """actor_loss on a micro-batch of ``t`` (the tensors) with ``mask`` as response_mask; returns (loss, metrics,
    grad of logp, grad of entropy)."""
    logp = t["logp"].clone().requires_grad_(True)
    ent = t["ent"].clone().requires_grad_(True)
    micro = Batch({"response_mask": mask.long(), "advantages": t["adv"], "old_log_probs": t["old"],
                   "ref_log_probs": t["ref"]})
    tokens, seqs = global_counts(mask.long(), 1)
    info = {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": seqs, "loss_scale_factor": LOSS_SCALE}
    loss, metrics = actor_loss(cfg, micro, logp, ent, info, use_old=True)
    loss.backward()
    return loss.detach(), metrics, logp.grad, ent.grad


LOSSES = [("token-mean", "vanilla", {}), ("seq-mean-token-sum", "vanilla", {}),
          ("seq-mean-token-mean", "vanilla", {}), ("seq-mean-token-sum-norm", "vanilla", {}),
          ("token-mean", "vanilla", {"actor__clip_ratio_high": 0.28}),  # DAPO's clip-higher
          ("seq-mean-token-mean", "gspo", {"actor__clip_ratio_low": 3e-4, "actor__clip_ratio_high": 4e-4}),
          ("token-mean", "cispo", {})]


@pytest.mark.parametrize("mode,loss_mode,extra", LOSSES)
def test_actor_loss_ignores_tool_tokens(base_cfg, mode, loss_mode, extra):
    cfg = cfg_with(base_cfg, actor__loss_agg_mode=mode, actor__policy_loss__loss_mode=loss_mode,
                   actor__entropy_coeff=0.01, actor__use_kl_loss=True, actor__kl_loss_coef=0.1, **extra)
    logp = per_token(1, 0.0).clamp(max=-0.05)  # tool tokens: the rollout's 0.0 convention
    full = {"logp": logp, "old": logp.detach() + 0.3 * per_token(2, -25.0), "adv": per_token(3, 50.0),
            "ref": logp.detach() + 0.2 * per_token(4, 30.0), "ent": per_token(5, 1e3).abs()}
    full["old"] = torch.where(TOOL, torch.full_like(logp, -25.0), full["old"])
    loss, metrics, g_logp, g_ent = run_actor_loss(cfg, M, full)
    c_loss, c_metrics, c_logp, c_ent = run_actor_loss(cfg, CM, {k: compact(v) for k, v in full.items()})
    assert torch.allclose(loss, c_loss, rtol=1e-9, atol=1e-12), (loss, c_loss)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert metrics[key] == pytest.approx(c_metrics[key], rel=1e-9, abs=1e-12), key
    if loss_mode != "gspo":  # gspo's tiny clip leaves every ratio clipped, vanilla's default clips some
        assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0 or loss_mode == "cispo"
    assert bool((g_logp[~M] == 0).all()) and bool((g_ent[~M] == 0).all())  # tool tokens and padding: exactly 0
    assert torch.allclose(compact(g_logp), c_logp, rtol=1e-9, atol=1e-15)
    assert torch.allclose(compact(g_ent), c_ent, rtol=1e-9, atol=1e-15)
    assert bool((g_logp[M] != 0).any())


def rewards_batch(batch: Batch) -> Batch:
    """``batch`` with an outcome score on each row's last model token and a turn reward on row 0's first turn end."""
    b = Batch(dict(batch.tensors), batch.meta, batch.info)
    scores = torch.zeros(M.shape, dtype=torch.float32)
    last = [int(torch.nonzero(M[i]).max()) for i in range(M.shape[0])]
    for i, (pos, s) in enumerate(zip(last, [1.0, 0.0, 0.0, 1.0])):
        scores[i, pos] = s
    scores[0, 2] += 0.5  # a turn reward at turn 1's end (a model token)
    b["token_level_scores"] = scores
    b["token_level_rewards"] = scores
    return b


def compacted_batch(batch: Batch) -> Batch:
    """The same rollout with the tool tokens removed (every (B, T) tensor compacted)."""
    T = M.shape[1]
    tensors = {k: compact(v) for k, v in batch.tensors.items() if v.dim() == 2 and v.shape[1] == T}
    tensors["response_mask"] = CM.long()
    return Batch(tensors, {"uid": batch.meta["uid"]})


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_plus_plus", "rloo", "opo"])
def test_advantages_skip_tool_tokens(base_cfg, estimator):
    """GAE carries nextV / the running advantage across a tool span (verl's masked GAE): it equals GAE on the
    batch without the tool tokens, so a tool token is no time step. Outcome estimators see the same scores."""
    cfg = cfg_with(base_cfg, algorithm__adv_estimator=estimator, algorithm__gamma=0.9, algorithm__lam=0.8)
    full = rewards_batch(BATCH)
    full["values"] = per_token(6, 1e3).float()  # the critic's values on tool tokens: ignored
    small = compacted_batch(full)
    compute_batch_advantages(cfg, full)
    compute_batch_advantages(cfg, small)
    for key in ("advantages", "returns"):
        assert bool((full.tensors[key][~M] == 0).all()), key
        assert torch.allclose(compact(full.tensors[key]), small.tensors[key], atol=1e-6), key
    assert bool((full.tensors["advantages"][M] != 0).any())


def test_kl_in_reward_skips_tool_tokens(base_cfg):
    cfg = cfg_with(base_cfg, algorithm__use_kl_in_reward=True, algorithm__kl_penalty="low_var_kl")
    full = rewards_batch(BATCH)
    full["old_log_probs"] = per_token(7, 0.0).float()
    full["ref_log_probs"] = per_token(8, -20.0).float()
    small = compacted_batch(full)
    m_full = apply_reward_kl(cfg, full, get_kl_controller("fixed", 0.2))
    m_small = apply_reward_kl(cfg, small, get_kl_controller("fixed", 0.2))
    r = full.tensors["token_level_rewards"]
    assert torch.equal(r[~M], full.tensors["token_level_scores"][~M])  # no penalty on tool tokens or padding
    assert torch.allclose(compact(r), small.tensors["token_level_rewards"], atol=1e-7)
    assert m_full["actor/reward_kl_penalty"] == pytest.approx(m_small["actor/reward_kl_penalty"], rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_value_loss_skips_tool_tokens(mode):
    """The critic's loss (portrl/workers/critic.py: compute_value_loss with the mini-batch's counts)."""
    def run(mask, vpreds, returns, values):
        v = vpreds.clone().requires_grad_(True)
        tokens, seqs = global_counts(mask.long(), 1)
        loss, clipfrac = compute_value_loss(v, returns, values, mask.long(), 0.5, mode, dp_size=1,
                                            batch_num_tokens=tokens, global_batch_size=seqs)
        loss.backward()
        return loss.detach(), clipfrac, v.grad

    t = (per_token(9, 40.0), per_token(10, -40.0), per_token(11, 7.0))
    loss, frac, grad = run(M, *t)
    c_loss, c_frac, c_grad = run(CM, *(compact(x) for x in t))
    assert torch.allclose(loss, c_loss, rtol=1e-12) and float(frac) == pytest.approx(float(c_frac))
    assert bool((grad[~M] == 0).all()) and torch.allclose(compact(grad), c_grad, rtol=1e-12)


def test_step_metrics_lengths(base_cfg):
    """response_length/* count every valid token (verl's); response_length/model_mean the model's."""
    b = rewards_batch(BATCH)
    cfg = cfg_with(base_cfg, algorithm__adv_estimator="grpo")
    compute_batch_advantages(cfg, b)
    b["acc"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    m = data_metrics(b, max_response_length=8)
    assert m["response_length/mean"] == 6.0 and m["response_length/max"] == 8.0 and m["response_length/min"] == 4.0
    assert m["response_length/clip_ratio"] == 0.25  # row 2 used the whole budget, 3 of its 8 tokens the tool's
    assert m["response_length/model_mean"] == pytest.approx(19 / 4)
    adv = b.tensors["advantages"][M]
    assert m["critic/advantages/mean"] == pytest.approx(float(adv.mean())) and m["critic/advantages/min"] < 0
    single = Batch(dict(b.tensors), {k: v for k, v in b.meta.items() if k != META_NUM_TURNS})
    assert "response_length/model_mean" not in data_metrics(single, 8)


def test_decode_responses_keeps_tool_text():
    tok = build_char_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    t = Trajectory(prompt_ids=enc("q"))
    t.add_model_tokens(enc("<tool_call>2+2</tool_call>"), [0.0] * 26)
    t.add_context_tokens(enc("\n<tool_response>4</tool_response>\n"))
    t.add_model_tokens(enc("four") + [tok.eos_token_id], [0.0] * 5)
    short = Trajectory(prompt_ids=enc("qq"))
    short.add_model_tokens(enc("ok"), [0.0, 0.0])
    batch = build_rollout_batch([t.prompt_ids, short.prompt_ids], [t.response_ids, short.response_ids],
                                pad_token_id=tok.pad_token_id)
    batch["response_mask"] = torch.tensor([t.response_mask, short.response_mask + [0] * (len(t.response_mask) - 2)])
    assert decode_responses(tok, batch) == ["<tool_call>2+2</tool_call>\n<tool_response>4</tool_response>\nfour",
                                            "ok"]


def test_place_turn_rewards_exact():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0], [0] * 7])
    scores = torch.zeros(3, 7)
    scores[0, 5], scores[1, 4] = 1.0, -1.0
    out = place_turn_rewards(scores, mask, [[1, 5], [3, 1], [2]], [[0.25, 0.5], [2.0, 3.0], [9.0]])
    want = torch.zeros(3, 7)
    want[0, 1], want[0, 5] = 0.25, 1.5  # turn ends at 1 and 5; the outcome stays at 5
    want[1, 3], want[1, 4] = 2.0, -1.0
    want[1, 4] += 3.0  # a turn ending before any model token: the row's last model token
    assert torch.equal(out, want) and scores[0, 1] == 0  # a new tensor
    tool_end = place_turn_rewards(torch.zeros(1, 7), mask[:1], [[3]], [[1.0]])  # an empty turn ending on a tool token
    assert tool_end[0, 1] == 1.0 and tool_end.sum() == 1.0
    with pytest.raises(ValueError, match="outside its 7 positions"):
        place_turn_rewards(scores, mask, [[7], [], []], [[1.0], [], []])
    with pytest.raises(ValueError, match="2 turn ends but 1 turn rewards"):
        place_turn_rewards(scores, mask, [[1, 5], [], []], [[1.0], [], []])


REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    extra_info["seen"] = True  # a copy: the batch's dict stays as it was
    return {"score": float(extra_info["num_turns"]), "turn_sum": sum(extra_info["turn_rewards"]),
            "tag": extra_info.get("tag")}
'''


def test_reward_scorer_turn_info_and_placement(base_cfg, tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD_FN)
    cfg = compose(device="cpu", overrides=[f"reward.custom.path={path}", "rollout.multi_turn.place_turn_rewards=true",
                                           "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                                           "data.max_response_length=8"])
    trajs = trajectories()
    trajs[0].turn_rewards = [0.5, 0.0]
    trajs[2].turn_rewards = [-0.25, 0.125]
    b = rollout(trajs)
    infos = [{"tag": i} for i in range(4)]
    b.meta.update({"data_source": ["mine"] * 4, "ground_truth": [""] * 4, "extra_info": infos})
    scorer = RewardScorer(cfg, build_char_tokenizer())
    out = scorer.compute_reward(b)
    overlong = [-0.75, 0.0, -1.0, -0.25]  # from the lengths 7, 4, 8, 5 (tool tokens count), buffer 4 of 8
    want_seq = [n + p for n, p in zip([2, 1, 2, 1], overlong)]
    assert out.tensors["seq_scores"].tolist() == pytest.approx(want_seq)
    assert out.meta["reward_extra/turn_sum"] == [0.5, 0.0, -0.125, 0.0]
    assert out.meta["reward_extra/tag"] == [0, 1, 2, 3]
    assert all("num_turns" not in d and "seen" not in d for d in b.meta["extra_info"])
    tls = out.tensors["token_level_scores"]
    want = torch.zeros_like(tls)
    for i, last in enumerate([6, 3, 7, 4]):
        want[i, last] = want_seq[i]
    want[0, 2] += 0.5
    want[2, 1] += -0.25
    want[2, 7] += 0.125
    assert torch.allclose(tls, want) and bool((tls[TOOL] == 0).all())
    scorer.manager.close()
    off = RewardScorer(compose(device="cpu", overrides=[f"reward.custom.path={path}"]), build_char_tokenizer())
    plain = off.compute_reward(b).tensors["token_level_scores"]
    assert plain[0, 2] == 0 and plain.sum(-1).tolist() == pytest.approx([2, 1, 2, 1])  # no placement, no shaping
