"""Validation: the prompts of ``data.val_files`` and their accuracy and score per data source, generated with
``rollout.val_kwargs`` (greedy by default; mean@k over ``val_kwargs.n`` samples otherwise).

A run whose code sandbox runs without parts of its isolation (accepted by ``sandbox.allow_unisolated=true``,
portrl.trainer.sandbox_check) logs it with every validation: a warning line ``validation at step N: val/acc/mean=...
(the code sandbox runs UNISOLATED (what is missing: why))``."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from portrl.rewards import per_source_metrics
from portrl.trainer.agent_metrics import agent_metrics
from portrl.trainer.generation import generation_seed, prompt_batch, run_dataset, sampling_params
from portrl.progress import activity
from portrl.trainer.sandbox_check import unisolated_note
from portrl.workers.batch import Batch, response_lengths

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

log = logging.getLogger(__name__)


def validation_prompts(cfg: PortRLConfig, files: List[str], tokenizer: Any, processor: Any) -> Optional[Batch]:
    """The validation prompts of ``files`` (at most ``data.max_val_samples``, in file order); None without files
    or when no validation runs (``trainer.test_freq`` <= 0 and no ``trainer.val_before_train``)."""
    if not files or int(cfg.trainer.test_freq) <= 0 and not cfg.trainer.val_before_train:
        return None
    d = cfg.data
    ds = run_dataset(cfg, files, tokenizer, processor, shuffle=False, seed=0)
    n = ds.num_rows if d.max_val_samples is None else min(ds.num_rows, int(d.max_val_samples))
    return prompt_batch(next(ds.batches(ds.num_rows))).slice(0, n)


def validate(cfg: PortRLConfig, gen: Any, reward: Any, prompts: Optional[Batch], step: int,
             extra: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    """``val/*`` metrics of ``prompts`` generated on ``gen`` and scored by ``reward`` in chunks of
    ``data.val_batch_size`` (with multi-turn rollouts also ``val/agent/*``); {} without prompts. ``extra``: keyword
    arguments of the generate calls (the asynchronous modes' ``min_version``: validation sees the current policy)."""
    if prompts is None:
        return {}
    t0 = time.perf_counter()
    size = cfg.data.val_batch_size or len(prompts)
    sources: List[str] = []
    acc, score, lens, generated = [], [], [], []
    chunks = prompts.split(int(size))
    with activity("validation") as shown:  # the console shows it while it runs (portrl.progress)
        for i, chunk in enumerate(chunks):
            shown[2] = f"{i * int(size)}/{len(prompts)} prompts done" if len(chunks) > 1 else ""
            # by name: the stand-in groups of tests/test_agent_traces.py compare it (Generates.generate_from)
            b = gen.concat("generate_from", chunk, sampling_params(cfg, generation_seed(cfg, 10**6 + step, i),
                                                                  greedy=True), **(extra or {}))
            r = reward.compute_reward(b)
            generated.append(Batch(meta=b.meta))  # its meta alone: what agent_metrics reads
            sources += [str(s) for s in b.meta["data_source"]]
            acc.append(r.tensors["acc"].float())
            score.append(r.tensors["seq_scores"].float())
            lens.append(response_lengths(b).float())  # all valid tokens, as response_length/* (metrics.py)
    a, s = torch.cat(acc), torch.cat(score)
    out = {k: v for k, v in per_source_metrics(sources, s, a, prefix="val/").items() if "/count/" not in k}
    out["val/acc/mean"] = float(a.mean())
    out["val/score/mean"] = float(s.mean())
    out["val/response_length/mean"] = float(torch.cat(lens).mean())
    out.update(agent_metrics(generated, prefix="val/"))  # multi-turn rollouts only (portrl.trainer.agent_metrics)
    out["timing_s/val"] = time.perf_counter() - t0
    note = unisolated_note()
    if note is not None:  # every validation says it: the scores came from programs that could read the answers
        log.warning("validation at step %d: val/acc/mean=%.4g val/score/mean=%.4g (the code sandbox runs %s; "
                    "sandbox.allow_unisolated=true)", max(step, 0), out["val/acc/mean"], out["val/score/mean"], note)
    return out
