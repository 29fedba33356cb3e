"""Supervised fine-tuning (the warm start of the built-in task, and ``portrl sft``), packed, on every backend.

Each example is laid out like a rollout (left-padded prompt + right-padded response, EOS included)
and scored with :func:`portrl.models.compute_logprobs` (packed rows, chunked log-probs), so SFT
uses exactly the forward RL uses. Loss: mean negative log-likelihood over response tokens,
``L = -Σ logp·m / Σ m`` (global over data-parallel ranks when ``world_size > 1``). AdamW, linear
warm-up over the first 5% of steps then cosine decay to 10%, gradient clipping at 1.0.
"""

from __future__ import annotations

import random
import time
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from portrl.data.rl_dataset import encode_messages
from portrl.models import compute_logprobs
from portrl.workers.batch import build_rollout_batch
from portrl.workers.master_weights import MasterWeights
from portrl.workers.training import all_reduce_sum, clip_and_step, lr_multiplier

Row = Union[Mapping[str, Any], Any]


def encode_sft_rows(tokenizer: Any, rows: Sequence[Row]) -> List[tuple]:
    """(prompt_ids, response_ids + [eos]) per row. A row is a dict with ``prompt`` (chat messages) and
    ``response`` (str), or an object with ``prompt_ids`` / ``response_ids`` (portrl.data.SFTExample)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("run_sft: the tokenizer has no eos_token; responses must end with it")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):  # an SFTExample: prompt_ids / response_ids
            out.append((list(row.prompt_ids), list(row.response_ids)))
            continue
        if "prompt" not in row or "response" not in row:
            raise ValueError(f"run_sft: row {i} needs 'prompt' (chat messages) and 'response' (str); has {sorted(row)}")
        messages = [dict(m) for m in row["prompt"]]
        p = encode_messages(tokenizer, messages)
        r = list(tokenizer(str(row["response"]), add_special_tokens=False)["input_ids"]) + [int(eos)]
        out.append((p, r))
    if not out:
        raise ValueError("run_sft: no rows")
    return out


def run_sft(cfg: Any, model: torch.nn.Module, tokenizer: Any, rows: Sequence[Row], steps: int, lr: float,
            batch_size: int, *, device: Optional[torch.device] = None, world_size: int = 1, rank: int = 0,
            seed: int = 0, log_every: int = 0, grad_clip: float = 1.0, forward: Optional[Any] = None,
            schedule_steps: Optional[int] = None, stop: Optional[Callable[[int], bool]] = None,
            target_answer_p: Optional[float] = None, check_every: int = 50,
            master: Optional[MasterWeights] = None) -> Dict[str, float]:
    """Train ``model`` in place for ``steps`` optimizer steps of ``batch_size`` examples (per rank).

    ``schedule_steps``: the length the LR schedule (warm-up, cosine) is laid out for; default ``steps``.
    A larger value stops part-way through a longer run: the first ``steps`` steps of a
    ``schedule_steps``-step SFT, exactly (same examples, same learning rates). ``stop(k)`` is called after
    the k-th optimizer step (model in train mode); True ends the SFT there (a single-process helper: with
    several ranks every rank must answer the same).

    ``target_answer_p`` (default ``cfg.model.sft_target_answer_p``; None = off): end the SFT once the mean
    probability of the right response (teacher-forced, EOS included) on the first PROBE_ROWS rows reaches
    it, checked every ``check_every`` steps (on every rank, averaged over the ranks, so all stop together).
    ``steps`` stays the schedule's length and the cap. Where a given step count gets this SFT moves with
    floating-point details; a stop on the model's own answers follows the model instead.

    ``master``: the :class:`~portrl.workers.master_weights.MasterWeights` that own ``model``'s float32 weights
    (a worker's, so the SFT updates the masters its RL optimizer steps from); None = made here.

    ``forward``: the log-prob forward, ``forward(input_ids, attention_mask, response_length=, packed=,
    chunk_size=) -> (logp, entropy)``; None = :func:`portrl.models.compute_logprobs` on ``model``. A
    data-parallel worker passes its wrapped model (portrl.workers.parallel.ForwardModule under DDP /
    FSDP2), so the wrapper's gradient all-reduce runs. Each rank draws its own examples (seeded by rank).

    Returns ``{"sft/loss_first", "sft/loss_last" (mean of the last 10 steps), "sft/steps" (steps done),
    "sft/tokens_per_s", "sft/time_s"}``, and ``"sft/answer_p"`` (the P(answer) it stopped at) when the
    target ended it. ``cfg``
    supplies model.use_packing, model.logprob_chunk_size and model.sft_target_answer_p.
    """
    forward = forward or partial(compute_logprobs, model)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"run_sft: steps, batch_size and lr must be positive (got {steps}, {batch_size}, {lr})")
    schedule = steps if schedule_steps is None else int(schedule_steps)
    if schedule < steps:
        raise ValueError(f"run_sft: schedule_steps ({schedule}) must be at least steps ({steps})")
    data = encode_sft_rows(tokenizer, rows)
    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    master = master or MasterWeights(model)  # float32 masters (of the weights as they are, if none are given)
    opt = torch.optim.AdamW(master.masters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    warmup = max(1, schedule // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, schedule, warmup, "cosine", 0.1))
    rng = random.Random(f"sft:{seed}:{rank}" if world_size > 1 else f"sft:{seed}")
    order: List[int] = []
    losses: List[float] = []
    tokens = 0
    packed = bool(cfg.model.use_packing) if cfg is not None else True
    chunk = cfg.model.logprob_chunk_size if cfg is not None else None
    if target_answer_p is None and cfg is not None:
        target_answer_p = getattr(cfg.model, "sft_target_answer_p", None)
    probe = None
    if target_answer_p is not None:
        if check_every < 1:
            raise ValueError(f"run_sft: check_every must be positive (got {check_every})")
        pb = build_rollout_batch([p for p, _ in data[:PROBE_ROWS]], [r for _, r in data[:PROBE_ROWS]],
                                 pad_token_id=pad).to(device)
        probe = partial(_answer_p, forward, pb, packed, chunk, world_size)
    answer_p = None
    was_training = model.training
    model.train()
    t0 = time.perf_counter()
    done = 0
    for step in range(steps):
        if len(order) < batch_size:
            more = list(range(len(data)))
            rng.shuffle(more)
            order += more
        pick, order = order[:batch_size], order[batch_size:]
        b = build_rollout_batch([data[i][0] for i in pick], [data[i][1] for i in pick], pad_token_id=pad).to(device)
        mask = b.tensors["response_mask"]
        n_tok = all_reduce_sum([float(mask.sum())], world_size)[0]
        logp, _ = forward(b.tensors["input_ids"], b.tensors["attention_mask"],
                          response_length=mask.shape[1], packed=packed, chunk_size=chunk)
        loss = -(logp * mask).sum() / n_tok * world_size
        master.zero_grad()
        loss.backward()
        clip_and_step(opt, master, grad_clip)
        sched.step()
        losses.append(float(loss.detach()) / world_size)
        tokens += int(b.tensors["attention_mask"].sum())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
        done = step + 1
        if probe is not None and done % check_every == 0 and done < steps:
            model.eval()
            answer_p = probe()
            model.train()
            if target_answer_p is not None and answer_p >= target_answer_p:
                break
        if stop is not None:
            if stop(done):
                break
            model.train()
    model.train(was_training)
    elapsed = time.perf_counter() - t0
    tail = losses[-10:]
    out = {"sft/loss_first": losses[0], "sft/loss_last": sum(tail) / len(tail), "sft/steps": float(done),
           "sft/tokens_per_s": tokens / max(elapsed, 1e-9), "sft/time_s": elapsed}
    if answer_p is not None and target_answer_p is not None and answer_p >= target_answer_p:
        out["sft/answer_p"] = answer_p
    return out


PROBE_ROWS = 64  # rows the target_answer_p check scores (the first of the SFT data)


@torch.no_grad()
def _answer_p(forward: Any, batch: Any, packed: bool, chunk: Optional[int], world_size: int) -> float:
    """Mean over ``batch``'s rows of P(response | prompt), teacher-forced, averaged over the ranks."""
    mask = batch.tensors["response_mask"]
    logp, _ = forward(batch.tensors["input_ids"], batch.tensors["attention_mask"], response_length=mask.shape[1],
                      packed=packed, chunk_size=chunk)
    total = all_reduce_sum([float((logp.float() * mask).sum(-1).exp().mean())], world_size)[0]
    return total / world_size

