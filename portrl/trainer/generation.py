"""Generation of a step's batch in the trainer's process: the sampling settings, the generation seeds, DAPO's
dynamic sampling (keep generating until ``data.train_batch_size`` informative groups) and ReMax's greedy
baselines. Generation seeds derive from (``trainer.seed``, step, batch), so a resumed run samples what an
uninterrupted run samples.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Protocol, Tuple

import torch

from portrl.agent.rollout import prompt_tools
from portrl.algo import algorithm_spec
from portrl.data.rl_dataset import RLDataset
from portrl.trainer.group_filter import group_filter_enabled, keep_groups
from portrl.trainer.metrics import Timer
from portrl.workers.batch import Batch, concat_rollouts

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig
    from portrl.workers.group import WorkerGroup

log = logging.getLogger(__name__)


class Generates(Protocol):
    """What the workers a run generates on answer (the colocated actor, or separated rollout workers): the worker
    class of its generation group, ``WorkerGroup[Generates]``."""

    def generate_from(self, prompts: Batch, sampling: Mapping[str, Any]) -> Batch: ...


def sampling_params(cfg: PortRLConfig, seed: int, greedy: bool = False) -> Dict[str, Any]:
    """The sampling settings of a training batch (``rollout``), or with ``greedy`` of validation
    (``rollout.val_kwargs``); ``seed`` seeds the engine's sampling."""
    r = cfg.rollout.val_kwargs if greedy else cfg.rollout
    return {"n": int(r.n), "temperature": float(r.temperature), "top_p": float(r.top_p), "top_k": int(r.top_k),
            "max_new_tokens": int(cfg.data.max_response_length), "seed": seed}


def generation_seed(cfg: PortRLConfig, step: int, k: int) -> int:
    """The seed of generation batch ``k`` of ``step`` (validation: step 10**6 + step; baselines: k 500+)."""
    return (int(cfg.trainer.seed) * 1_000_003 + step * 1009 + k) % (2**62)


def run_dataset(cfg: PortRLConfig, files: List[str], tokenizer: Any, processor: Any, shuffle: bool, seed: int) -> Any:
    """The RLDataset of ``files`` with the run's ``data`` settings; with ``rollout.multi_turn.enable`` the prompts
    list the run's tools where the chat template does (their schemas from ``tool_config_path``)."""
    d = cfg.data
    return RLDataset(files, tokenizer, max_prompt_length=int(d.max_prompt_length),
                     filter_overlong_prompts=bool(d.filter_overlong_prompts), truncation=str(d.truncation),
                     shuffle=shuffle, seed=seed, processor=processor, tools=prompt_tools(cfg))


def prompt_batch(pb: Any) -> Batch:
    """A PromptBatch as a Batch of per-prompt meta (the form generate_from takes); ``multi_modal`` only when
    some prompt has images, ``agent_name`` only when some row names its agent loop (portrl/data/rl_dataset.py);
    ``messages``: the prompt's chat messages (a multi-turn trajectory's trace starts with them)."""
    extra = {"multi_modal": pb.multi_modal} if any(m is not None for m in pb.multi_modal or ()) else {}
    if getattr(pb, "agent_name", None):
        extra["agent_name"] = pb.agent_name
    return Batch(meta={"prompt_ids": pb.prompt_ids, "uid": pb.uid, "data_source": pb.data_source,
                       "ground_truth": pb.ground_truth, "extra_info": pb.extra_info, "messages": pb.messages,
                       **extra})


class StepGeneration:
    """Generates and scores a step's batch on ``gen`` (the actor group, or separated rollout workers:
    ``records_forward`` False) with requests of ``pipeline`` (portrl/trainer/rollout_pipeline.py: generated at the
    step, or ahead of it in the asynchronous modes) and rewards from ``reward``."""

    def __init__(self, cfg: PortRLConfig, gen: WorkerGroup[Generates], reward: Any, tokenizer: Any, pipeline: Any,
                 records_forward: bool):
        self.cfg, self.gen, self.reward, self.tokenizer = cfg, gen, reward, tokenizer
        self.pipeline, self.records_forward = pipeline, records_forward

    def rollout(self, step: int, timer: Timer, for_update: bool = True,
                version: int = 0) -> Tuple[Optional[Batch], Dict[str, float]]:
        """Generate and score; with dynamic sampling keep generating until train_batch_size informative groups.
        ``for_update``: the actor will train on this batch (it may record the rollout's forward for that);
        ``version``: the policy version last sent to the rollout. (None, metrics) when dynamic sampling kept no
        group. Metrics ``data/gen_batch_first`` / ``_last``: the run-wide indices of the prompt batches used."""
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        want = int(cfg.data.train_batch_size)
        kept: List[Batch] = []
        n_prompts, gen_batches = 0, 0
        metrics: Dict[str, float] = {}
        extra = {"for_update": for_update} if self.records_forward else {}
        while True:
            with timer("gen"):
                prompts, batch, index = self.pipeline.take(step, version, extra)
            metrics.setdefault("data/gen_batch_first", float(index))
            metrics["data/gen_batch_last"] = float(index)
            gen_batches += 1
            with timer("reward"):
                batch.union(self.reward.compute_reward(batch))
                if algorithm_spec(cfg.algorithm).needs_greedy_baseline:
                    batch["reward_baselines"] = self.greedy_baselines(prompts, step, gen_batches)
            if not group_filter_enabled(cfg):
                return batch, metrics
            keep = keep_groups(cfg, batch)  # DAPO's dynamic sampling, verl's accuracy / truncation filters
            if bool(keep.any()):
                kept.append(batch.select(keep))
                n_prompts += len(set(kept[-1].meta["uid"]))
            if n_prompts >= want:
                break
            if int(fg.max_num_gen_batches) > 0 and gen_batches >= int(fg.max_num_gen_batches):
                log.warning("dynamic sampling: %d informative groups after %d generation batches (max_num_gen_batches);"
                            " training on those", n_prompts, gen_batches)
                break
        metrics["train/num_gen_batches"] = float(gen_batches)
        metrics["train/num_kept_groups"] = float(min(n_prompts, want))
        if not kept:
            return None, metrics
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = concat_rollouts(kept, pad)
        return batch.slice(0, min(len(batch), want * int(cfg.rollout.n))), metrics

    def greedy_baselines(self, prompts: Batch, step: int, k: int) -> torch.Tensor:
        """ReMax: the reward of each prompt's greedy response, repeated for its n samples."""
        greedy = dict(sampling_params(self.cfg, generation_seed(self.cfg, step, 500 + k)), n=1, temperature=0.0)
        g = self.gen.concat(Generates.generate_from, prompts, greedy)
        scores = self.reward.compute_reward(g).tensors["seq_scores"]
        return scores.repeat_interleave(int(self.cfg.rollout.n))
