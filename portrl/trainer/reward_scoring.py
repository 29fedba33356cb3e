"""RewardScorer: scores rollouts in the trainer's process with rule rewards (portrl.rewards.RewardManager) or a
reward model.

``compute_reward(batch) -> Batch(token_level_scores (B,T), seq_scores (B,), acc (B,))``: the
sequence score sits on the last response token the model wrote (``response_mask``; verl's convention), zeros
elsewhere. The text scored is the whole response, and its length (DAPO's overlong shaping) all of its valid
tokens: in a multi-turn rollout the tool / environment tokens between the model's turns too
(portrl.workers.batch.response_valid_mask).

Multi-turn rollouts (the batch's meta ``num_turns``, ``turn_rewards``, ``turn_ends``: portrl/agent/trajectory.py):
the reward function's ``extra_info`` gets ``num_turns`` and ``turn_rewards`` (portrl.rewards.manager.turn_extra_infos);
with ``rollout.multi_turn.place_turn_rewards`` each turn's reward is also added to ``token_level_scores`` at the
turn's last token (portrl.rewards.manager.place_turn_rewards). ``seq_scores`` stays the outcome score.

Reward model (``reward.model_path``): a local Hugging Face sequence-classification model scores
the decoded (prompt, response) texts (portrl.trainer.reward_model_scorer.RewardModelScorer, with its own
tokenizer); ``acc`` is then ``score > 0``; rule rewards are not used.

Rule rewards have a time limit per batch (``reward.timeout_s``, ``reward.on_timeout``:
portrl.rewards.manager); a reward model does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

import torch

from portrl.agent.trajectory import META_NUM_TURNS, META_TURN_ENDS, META_TURN_REWARDS
from portrl.rewards import RewardManager, place_on_last_token
from portrl.rewards.manager import place_turn_rewards, turn_extra_infos
from portrl.trainer.reward_model_scorer import RewardModelScorer
from portrl.workers.batch import Batch, response_lengths, response_valid_mask
from portrl.workers.setup import worker_backend

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig


def decode_responses(tokenizer: Any, batch: Batch) -> List[str]:
    """Text of every response: all its valid tokens (a multi-turn response's tool / environment tokens too,
    portrl.workers.batch.response_valid_mask), padding removed, special tokens skipped."""
    valid = response_valid_mask(batch).bool()
    ids = [row[m].tolist() for row, m in zip(batch.tensors["responses"], valid)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def _code_kwargs(code: Any, sandbox: Any = None) -> dict:
    """reward.code, with the sandbox's ``sandbox.allow_unisolated`` and ``sandbox.packages``, as the ``code``
    keyword of the built-in reward (portrl.rewards.registry); {} when reward.code is absent."""
    if code is None:
        return {}
    keys = ("continuous", "timeout_s", "memory_mb", "max_workers", "sandbox_fusion_url")
    out = {k: code.get(k) for k in keys if code.get(k) is not None}
    if sandbox is not None:
        out.update(allow_unisolated=bool(sandbox.allow_unisolated), packages=tuple(str(p) for p in sandbox.packages))
    return {"code": out}


class RewardScorer:
    """Rule rewards by ``data_source`` (plus custom function and overlong shaping), or a reward model."""

    def __init__(self, cfg: PortRLConfig, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        r = cfg.reward
        self.rm: RewardModelScorer | None = None
        self.place_turn_rewards = bool(cfg.rollout.multi_turn.place_turn_rewards)
        if r.model_path:
            self._load_reward_model(str(r.model_path))
            self.manager: RewardManager | None = None
        else:
            ob = r.overlong_buffer
            self.manager = RewardManager(
                custom_path=r.custom.path, custom_name=r.custom.name if r.custom.path else None,
                overlong_buffer={"enable": bool(ob.enable), "len": int(ob.len),
                                 "penalty_factor": float(ob.penalty_factor)},
                max_response_length=int(cfg.data.max_response_length), num_workers=int(r.num_workers),
                timeout_s=r.timeout_s, on_timeout=str(r.on_timeout or "error"),
                reward_kwargs=None if r.custom.path else _code_kwargs(r.code, cfg.sandbox))

    def _load_reward_model(self, path: str) -> None:
        self.rm = RewardModelScorer(path, worker_backend(self.cfg))

    def compute_reward(self, batch: Batch) -> Batch:
        texts = decode_responses(self.tokenizer, batch)
        if self.rm is not None:
            scores = self._model_scores(batch, texts)
            acc = (scores > 0).float()
            extra: dict = {}
        else:
            assert self.manager is not None  # built where there is no reward model
            infos = turn_extra_infos(batch.meta.get("extra_info", [None] * len(batch)),
                                     batch.meta.get(META_NUM_TURNS), batch.meta.get(META_TURN_REWARDS))
            res = self.manager.score(texts, batch.meta["data_source"], batch.meta["ground_truth"], infos,
                                     response_lengths(batch).tolist())
            scores, acc, extra = res.scores.float(), res.acc.float(), dict(res.extra or {})
        mask = batch.tensors["response_mask"]
        token_scores = place_on_last_token(scores, mask).float()
        if self.place_turn_rewards and META_TURN_ENDS in batch.meta and META_TURN_REWARDS in batch.meta:
            token_scores = place_turn_rewards(token_scores, mask, batch.meta[META_TURN_ENDS],
                                              batch.meta[META_TURN_REWARDS])
        out = Batch({"token_level_scores": token_scores, "seq_scores": scores, "acc": acc})
        for k, v in extra.items():
            if len(v) == len(batch):
                out.meta[f"reward_extra/{k}"] = list(v)
        return out

    def _model_scores(self, batch: Batch, texts: List[str]) -> torch.Tensor:
        assert self.rm is not None  # called only with a reward model
        P = batch.tensors["prompts"].shape[1]
        pmask = batch.tensors["attention_mask"][:, :P].bool()
        prompts = [row[m].tolist() for row, m in zip(batch.tensors["prompts"], pmask)]
        return self.rm.score(self.tokenizer.batch_decode(prompts, skip_special_tokens=True), texts).float()
