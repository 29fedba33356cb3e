"""RewardScorer: scores rollouts in the trainer's process with rule rewards (portrl.rewards.RewardManager) or a
reward model.

``compute_reward(batch) -> Batch(token_level_scores (B,T), seq_scores (B,), acc (B,))``: the
sequence score sits on the last response token (verl's convention), zeros elsewhere.

Reward model (``reward.model_path``): a local Hugging Face sequence-classification model scores
the decoded (prompt, response) texts (portrl.trainer.reward_model_scorer.RewardModelScorer, with its own
tokenizer); ``acc`` is then ``score > 0``; rule rewards are not used.

Rule rewards have a time limit per batch (``reward.timeout_s``, ``reward.on_timeout``:
portrl.rewards.manager); a reward model does not.
"""

from __future__ import annotations

from typing import Any, List

import torch

from portrl.rewards import RewardManager, place_on_last_token
from portrl.trainer.reward_model_scorer import RewardModelScorer
from portrl.workers.batch import Batch
from portrl.workers.setup import worker_backend


def decode_responses(tokenizer: Any, batch: Batch) -> List[str]:
    """Text of every response (padding removed, special tokens skipped)."""
    lens = batch.tensors["response_mask"].sum(-1).tolist()
    ids = batch.tensors["responses"].tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(ids, lens)], skip_special_tokens=True)


def _code_kwargs(code: Any) -> dict:
    """reward.code as the ``code`` keyword of the built-in reward (portrl.rewards.registry); {} when absent."""
    if code is None:
        return {}
    keys = ("continuous", "timeout_s", "memory_mb", "max_workers", "sandbox_fusion_url")
    return {"code": {k: code.get(k) for k in keys if code.get(k) is not None}}


class RewardScorer:
    """Rule rewards by ``data_source`` (plus custom function and overlong shaping), or a reward model."""

    def __init__(self, cfg: Any, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        r = cfg.reward
        self.rm: RewardModelScorer | None = None
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
                timeout_s=r.get("timeout_s"), on_timeout=str(r.get("on_timeout") or "error"),
                reward_kwargs=None if r.custom.path else _code_kwargs(r.get("code")))

    def _load_reward_model(self, path: str) -> None:
        self.rm = RewardModelScorer(path, worker_backend(self.cfg))

    def compute_reward(self, batch: Batch) -> Batch:
        texts = decode_responses(self.tokenizer, batch)
        lens = batch.tensors["response_mask"].sum(-1)
        if self.rm is not None:
            scores = self._model_scores(batch, texts)
            acc = (scores > 0).float()
            extra: dict = {}
        else:
            assert self.manager is not None  # built where there is no reward model
            res = self.manager.score(texts, batch.meta["data_source"], batch.meta["ground_truth"],
                                     batch.meta.get("extra_info", [None] * len(batch)), lens.tolist())
            scores, acc, extra = res.scores.float(), res.acc.float(), dict(res.extra or {})
        out = Batch({"token_level_scores": place_on_last_token(scores, batch.tensors["response_mask"]).float(),
                     "seq_scores": scores, "acc": acc})
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
