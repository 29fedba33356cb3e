"""Supervised fine-tuning (the warm start of the built-in task, and ``portrl sft``), packed, on every backend.

Each example is laid out like a rollout (left-padded prompt + right-padded response, EOS included)
and scored with :func:`portrl.models.compute_logprobs` (packed rows, chunked log-probs), so SFT
uses exactly the forward RL uses, and trains through RL's update loop (portrl.workers.update_loop: float32
masters, gradient clipping, the step skipped when not finite). Loss: mean negative log-likelihood over response
tokens, ``L = -Σ logp·m / Σ m`` (global over data-parallel ranks when ``world_size > 1``). AdamW, linear
warm-up over the first 5% of steps then cosine decay to 10%, gradient clipping at 1.0.
"""

from __future__ import annotations

import random
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch

from portrl.data.schema import DataError
from portrl.data.sft_encode import encode_sft_example
from portrl.models import compute_logprobs
from portrl.workers.batch import Batch, build_rollout_batch
from portrl.workers.master_weights import MasterWeights
from portrl.workers.training import all_reduce_sum, build_lr_scheduler, build_optimizer
from portrl.workers.update_loop import LoopSettings, Trainable, run_update

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

Row = Union[Mapping[str, Any], Any]


def encode_sft_rows(tokenizer: Any, rows: Sequence[Row]) -> List[tuple]:
    """(prompt_ids, response_ids, loss_mask) per row. A row is a dict with ``prompt`` (chat messages) and
    ``response`` (a string, or the conversation after the prompt as chat messages: the loss is then on its
    assistant messages only, portrl/data/sft_encode.py), or an object with ``prompt_ids`` / ``response_ids`` (and
    ``loss_mask``, None = every response token; portrl.data.SFTExample)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("run_sft: the tokenizer has no eos_token; responses must end with it")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):  # an SFTExample: prompt_ids / response_ids
            mask = getattr(row, "loss_mask", None)
            out.append((list(row.prompt_ids), list(row.response_ids),
                        [1] * len(row.response_ids) if mask is None else list(mask)))
            continue
        if "prompt" not in row or "response" not in row:
            raise ValueError(f"run_sft: row {i} needs 'prompt' (chat messages) and 'response' (str); has {sorted(row)}")
        try:
            response = row["response"]
            out.append(encode_sft_example(tokenizer, row["prompt"],
                                          response if isinstance(response, (list, tuple)) else str(response)))
        except DataError as exc:
            raise DataError(f"run_sft: row {i}: {exc}") from None
    if not out:
        raise ValueError("run_sft: no rows")
    return out


def run_sft(cfg: PortRLConfig, model: torch.nn.Module, tokenizer: Any, rows: Sequence[Row], steps: int, lr: float,
            batch_size: int, *, device: Optional[torch.device] = None, world_size: int = 1, rank: int = 0,
            seed: int = 0, log_every: int = 0, grad_clip: float = 1.0, forward: Optional[Any] = None,
            schedule_steps: Optional[int] = None, stop: Optional[Callable[[int], bool]] = None,
            target_answer_p: Optional[float] = None, check_every: int = 50,
            master: Optional[MasterWeights] = None) -> Dict[str, float]:
    """Train ``model`` in place for ``steps`` optimizer steps of ``batch_size`` examples (per rank), each one update
    of the shared loop (portrl.workers.update_loop: one mini-batch, one micro-batch, the step skipped when its loss
    or gradient norm is not finite).

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

    ``master``: the MasterWeights that own ``model``'s float32 weights (a worker's, so the SFT updates the masters
    its RL optimizer steps from); None = made here.

    ``forward``: the log-prob forward, ``forward(input_ids, attention_mask, response_length=, packed=, chunk_size=)
    -> (logp, entropy)``; None = :func:`portrl.models.compute_logprobs` on ``model``. A data-parallel worker passes
    its wrapped model (ForwardModule under DDP / FSDP2), so the wrapper's gradient all-reduce runs. Each rank draws
    its own examples (seeded by rank).

    Returns ``{"sft/loss_first", "sft/loss_last" (mean of the last 10 steps), "sft/steps" (steps done),
    "sft/tokens_per_s", "sft/time_s"}``, and ``"sft/answer_p"`` (the P(answer) it stopped at) when the
    target ended it. ``cfg`` supplies model.use_packing, model.logprob_chunk_size and model.sft_target_answer_p.
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
    packed, chunk, target_answer_p = _model_options(cfg, target_answer_p)
    probe = _probe(target_answer_p, forward, data, pad, device, packed, chunk, world_size, check_every)
    state = sft_trainable(model, master, lr, schedule, device)
    settings = LoopSettings(epochs=1, mini_rows=batch_size, micro_rows=batch_size, max_tokens=None,
                            grad_clip=grad_clip, loss_scale_factor=1, world_size=world_size)

    def nll(micro: Any, counts: Dict[str, Any], pos: Any):  # -Σ logp·m / Σ m, m summed over all ranks
        mask = micro.tensors["response_mask"]
        logp, _ = forward(micro.tensors["input_ids"], micro.tensors["attention_mask"],
                          response_length=mask.shape[1], packed=packed, chunk_size=chunk)
        loss = -(logp * mask).sum() / counts["batch_num_tokens"] * counts["dp_size"]
        return loss, {"sft/loss": float(loss.detach()) / counts["dp_size"]}

    batches = _batches(data, batch_size, random.Random(f"sft:{seed}:{rank}" if world_size > 1 else f"sft:{seed}"),
                       pad, device)
    losses: List[float] = []
    tokens, done, answer_p, was_training, t0 = 0, 0, None, model.training, time.perf_counter()
    model.train()
    for done, batch in zip(range(1, steps + 1), batches):
        losses.append(run_update(state, batch, settings, nll, prefix="sft", set_mode=False)["sft/loss"])
        tokens += int(batch.tensors["attention_mask"].sum())
        if log_every and done % log_every == 0:
            print(f"sft step {done}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
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
    return _summary(losses, done, tokens, time.perf_counter() - t0,
                    answer_p if answer_p is not None and answer_p >= target_answer_p else None)


def _model_options(cfg: PortRLConfig, target_answer_p: Optional[float]) -> tuple:
    """``(packed, chunk_size, target_answer_p)`` from ``cfg.model`` (None: packed, no chunks, the given target)."""
    if cfg is None:
        return True, None, target_answer_p
    m = cfg.model
    return bool(m.use_packing), m.logprob_chunk_size, (
        getattr(m, "sft_target_answer_p", None) if target_answer_p is None else target_answer_p)


def sft_trainable(model: torch.nn.Module, master: Optional[MasterWeights], lr: float, schedule: int,
                  device: torch.device) -> Trainable:
    """What the SFT trains (a Trainable of the shared loop): ``model``'s float32 masters (``master``, else made
    here, of the weights as they are), AdamW (betas 0.9 / 0.95, no weight decay, the multi-tensor implementation)
    and a schedule of ``schedule`` steps: linear warm-up over the first 5% (at least one step), then cosine decay to
    10% of ``lr``."""
    master = master or MasterWeights(model)
    opt = build_optimizer(master.masters, {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
                          fused=False)
    sched = build_lr_scheduler(opt, {"scheduler": "cosine", "warmup_steps": max(1, schedule // 20),
                                     "warmup_ratio": 0.0, "min_lr_ratio": 0.1}, schedule)
    return Trainable(model, master, opt, sched, device)


def _batches(data: List[tuple], batch_size: int, rng: random.Random, pad: int, device: torch.device) -> Iterator[Batch]:
    """Endless batches of ``batch_size`` examples: every example once per pass, each pass in ``rng``'s order."""
    order: List[int] = []
    while True:
        if len(order) < batch_size:
            more = list(range(len(data)))
            rng.shuffle(more)
            order += more
        pick, order = order[:batch_size], order[batch_size:]
        yield sft_batch([data[i] for i in pick], pad, device)


def sft_batch(examples: Sequence[tuple], pad: int, device: torch.device) -> Batch:
    """A rollout Batch of (prompt_ids, response_ids, loss_mask) examples whose ``response_mask`` is the loss mask
    (0 on a conversation's tool tokens, which ``attention_mask`` keeps: the multi-turn rollout layout)."""
    batch = build_rollout_batch([e[0] for e in examples], [e[1] for e in examples], pad_token_id=pad)
    mask = batch.tensors["response_mask"]
    for r, e in enumerate(examples):
        mask[r, :len(e[2])] = torch.as_tensor(e[2], dtype=mask.dtype)
    return batch.to(device)


def _probe(target_answer_p: Optional[float], forward: Any, data: List[tuple], pad: int, device: torch.device,
           packed: bool, chunk: Optional[int], world_size: int, check_every: int) -> Optional[Callable[[], float]]:
    """The target_answer_p check: P(answer) on the first PROBE_ROWS examples (:func:`_answer_p`); None without a
    target."""
    if target_answer_p is None:
        return None
    if check_every < 1:
        raise ValueError(f"run_sft: check_every must be positive (got {check_every})")
    pb = sft_batch(data[:PROBE_ROWS], pad, device)
    return partial(_answer_p, forward, pb, packed, chunk, world_size)


def _summary(losses: List[float], done: int, tokens: int, elapsed: float, answer_p: Optional[float]) -> Dict[str, float]:
    """run_sft's result (see there); ``answer_p``: the P(answer) that ended it, else None."""
    tail = losses[-10:]
    out = {"sft/loss_first": losses[0], "sft/loss_last": sum(tail) / len(tail), "sft/steps": float(done),
           "sft/tokens_per_s": tokens / max(elapsed, 1e-9), "sft/time_s": elapsed}
    if answer_p is not None:
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

