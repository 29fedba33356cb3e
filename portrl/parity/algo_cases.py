"""Parity cases of the algorithm core: every registered advantage estimator, policy loss, aggregation mode
and KL penalty, plus the value loss, KL loss, entropy, whitening and DPO / SPPO, on one fixed RL batch.

The batch: 16 responses (4 prompts x 4 samples) of up to 512 tokens (lengths 64..512), log-probs
around -1 with a policy that moved by ~0.1 nats per token (so some tokens clip at 0.2), scalar
rewards on the last token. Losses are differentiated with respect to the current log-probs (or
value predictions, logits, loss matrix).
"""

from __future__ import annotations

import torch

from portrl import algo
from portrl.parity.case import Case

BATCH, GROUP, RESP_LEN = 16, 4, 512
INDEX = [f"p{i // GROUP}" for i in range(BATCH)]
#: policy-loss config: verl's defaults, dro_beta set (dro needs it), one data-parallel rank; bypass_mode's
#: settings (its REINFORCE path with truncated token IS weights; the other losses ignore them)
LOSS_CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
               "dro_beta": 0.1, "global_batch_info": {},
               "rollout_correction": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0}}


def rl_batch(g: torch.Generator) -> dict:
    lengths = torch.randint(64, RESP_LEN + 1, (BATCH,), generator=g)
    mask = (torch.arange(RESP_LEN)[None] < lengths[:, None]).to(torch.int64)
    old = -torch.empty(BATCH, RESP_LEN).exponential_(1.0, generator=g)
    logp = (old + 0.1 * torch.randn(BATCH, RESP_LEN, generator=g)).clamp(max=0.0)
    ref = (old + 0.05 * torch.randn(BATCH, RESP_LEN, generator=g)).clamp(max=0.0)
    scores = torch.rand(BATCH, generator=g)
    rewards = torch.zeros(BATCH, RESP_LEN)
    rewards[torch.arange(BATCH), lengths - 1] = scores
    values = 0.5 * torch.randn(BATCH, RESP_LEN, generator=g)
    return {
        "response_mask": mask, "old_log_prob": old, "log_prob": logp, "ref_log_prob": ref,
        "advantages": torch.randn(BATCH, RESP_LEN, generator=g), "token_level_rewards": rewards,
        "values": values, "vpreds": values + 0.3 * torch.randn(BATCH, RESP_LEN, generator=g),
        "reward_baselines": torch.rand(BATCH, generator=g),
        "sum_pi_squared": 0.2 + 0.6 * torch.rand(BATCH, RESP_LEN, generator=g), "scores": scores,
        "returns": torch.randn(BATCH, RESP_LEN, generator=g), "loss_mat": torch.randn(BATCH, RESP_LEN, generator=g),
        "implicit_rewards": 0.05 * torch.randn(BATCH, RESP_LEN, generator=g),  # PRIME's token rewards
    }


def _advantage(name):
    critic = algo.estimator_spec(name).needs_critic  # the critic (GAE) family is checked with discounting

    def run(x):
        adv, ret = algo.compute_advantage(
            name, token_level_rewards=x["token_level_rewards"], response_mask=x["response_mask"], index=INDEX,
            values=x["values"], reward_baselines=x["reward_baselines"], old_log_probs=x["old_log_prob"],
            sum_pi_squared=x["sum_pi_squared"], implicit_rewards=x["implicit_rewards"], gamma=0.99 if critic else 1.0,
            lam=0.95)
        return {"advantages": adv, "returns": ret}
    return run


def _policy_loss(name):
    fn = algo.get_policy_loss(name)

    def run(x):
        loss, _ = fn(x["old_log_prob"], x["log_prob"], x["advantages"], x["response_mask"], "token-mean", LOSS_CONFIG)
        return {"loss": loss}
    return run


def _agg(mode):
    return lambda x: {"loss": algo.agg_loss(x["loss_mat"], x["response_mask"], mode)}


def _kl(name):
    return lambda x: {"kl": algo.kl_penalty(x["log_prob"], x["ref_log_prob"], name)}


def _value_loss(x):
    loss, _ = algo.compute_value_loss(x["vpreds"], x["returns"], x["values"],
                                      x["response_mask"], cliprange_value=0.2)
    return {"loss": loss}


def _kl_loss(x):
    return {"loss": algo.compute_kl_loss(x["log_prob"], x["ref_log_prob"], x["response_mask"])}


def _whiten(x):
    return {"out": algo.masked_whiten(x["advantages"], x["response_mask"])}


def _logits_inputs(g):
    return {"logits": 3.0 * torch.randn(2, 64, 32000, generator=g)}


def _entropy(x):
    return {"entropy": algo.entropy_from_logits(x["logits"], chunk_size=64)}


def _pairs(g):
    n = 32
    return {"pc": -100 + 20 * torch.randn(n, generator=g), "pr": -100 + 20 * torch.randn(n, generator=g),
            "rc": -100 + 20 * torch.randn(n, generator=g), "rr": -100 + 20 * torch.randn(n, generator=g)}


def _dpo(loss_type):
    def run(x):
        loss, _ = algo.dpo_loss(x["pc"], x["pr"], x["rc"], x["rr"], beta=0.1, loss_type=loss_type)
        return {"loss": loss}
    return run


def _sppo(x):
    adv = algo.sppo_advantage(x["scores"], beta=1.0, index=INDEX)
    loss, _ = algo.sppo_loss(x["old_log_prob"], x["log_prob"], adv, x["response_mask"], eta=1.0)
    return {"loss": loss, "advantage": adv}


def algo_cases() -> list[Case]:
    """One case per registered name of each algorithm registry, and one per other loss function."""
    cases = []

    def add(name, fn, grads=(), make=rl_batch):
        cases.append(Case(name=name, group="algo", make_inputs=make, fn=fn, grad_inputs=grads,
                          inputs_key="algo/batch" if make is rl_batch else None))

    for name in algo.registered("adv_estimator"):
        add(f"adv_estimator[{name}]", _advantage(name))
    for name in algo.registered("policy_loss"):
        add(f"policy_loss[{name}]", _policy_loss(name), ("log_prob",))
    for mode in algo.registered("loss_agg_mode"):
        add(f"loss_agg_mode[{mode}]", _agg(mode), ("loss_mat",))
    for name in algo.registered("kl_penalty"):
        add(f"kl_penalty[{name}]", _kl(name), ("log_prob",))
    add("value_loss", _value_loss, ("vpreds",))
    add("kl_loss[low_var_kl]", _kl_loss, ("log_prob",))
    add("masked_whiten", _whiten, ("advantages",))
    add("sppo", _sppo, ("log_prob",))
    add("entropy_from_logits", _entropy, ("logits",), make=_logits_inputs)
    add("dpo[sigmoid]", _dpo("sigmoid"), ("pc", "pr"), make=_pairs)
    add("dpo[ipo]", _dpo("ipo"), ("pc", "pr"), make=_pairs)
    return cases
