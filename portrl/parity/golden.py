"""Goldens: one recorded RL step of a fixed tiny model, and its replay on any backend.

``record_golden(dir)`` (on the reference backend, float32) writes:

* ``model/``: the tiny Qwen2 (``write_tiny_model(seed=0)``) and its tokenizer, so a replay never
  depends on how another transformers version initialises weights;
* ``batch.safetensors``: the rollout batch — ``input_ids``, ``attention_mask``, ``response_mask``
  (4 arith prompts x 2 samples, sampled from the model with a fixed seed) and ``token_level_rewards``.
  The rewards are seeded scores in [0, 1] on the last response token: a random tiny model never
  answers right, and all-zero rewards would give zero advantages and zero gradients;
* ``expected.safetensors``: ``old_log_probs``, ``entropy``, ``advantages`` (GRPO), the per-tensor
  ``weight_sum`` / ``weight_norm`` / ``update_norm`` after one update and ``new_log_probs`` after it;
* ``golden.json``: the step's settings, ``pg_loss``, ``grad_norm``, the environment it was recorded in.

The update is ``vanilla`` PPO-clip, token-mean, with one plain SGD step (lr 0.1): SGD keeps the
weight summary a smooth function of the gradient, where Adam's first step (about lr * sign(g))
would magnify the rounding of near-zero gradients.

``replay_golden(dir, backend, dtype)`` recomputes everything from ``batch.safetensors`` on the
backend and compares with :func:`portrl.parity.metrics.compare_tensors` under ``dtype``'s tolerances.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from portrl import algo
from portrl.data.arith import make_arith_rows
from portrl.models import compute_logprobs, load_causal_lm, load_tokenizer, write_tiny_model
from portrl.outputs import publish
from portrl.parity.metrics import compare_tensors
from portrl.parity.report import environment, write_json
from portrl.parity.tolerances import worst

if TYPE_CHECKING:
    from portrl.device.backend import Backend

GOLDEN_VERSION = 1
STEP = {"seed": 0, "prompts": 4, "samples": 2, "max_new_tokens": 24, "temperature": 1.0, "adv_estimator": "grpo",
        "policy_loss": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio": 0.2, "lr": 0.1, "max_grad_norm": 1.0}


def _sample_batch(model, tokenizer, step: dict) -> dict[str, torch.Tensor]:
    rows = make_arith_rows(step["prompts"], seed=step["seed"])
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    p_len = max(map(len, prompts))
    ids = torch.full((len(prompts), p_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, p_len - len(p):] = torch.tensor(p)
        mask[i, p_len - len(p):] = 1
    ids, mask = ids.repeat_interleave(step["samples"], 0), mask.repeat_interleave(step["samples"], 0)
    torch.manual_seed(step["seed"])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=step["temperature"],
                         top_k=0, top_p=1.0, max_new_tokens=step["max_new_tokens"], pad_token_id=pad,
                         eos_token_id=eos)
    resp = out[:, p_len:]
    t = resp.shape[1]
    # response_mask: tokens up to and including the first EOS
    is_eos = resp == eos
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
    response_mask = (~after_eos).long()
    resp = torch.where(response_mask.bool(), resp, torch.full_like(resp, pad))
    g = torch.Generator().manual_seed(step["seed"] + 1)
    scores = torch.rand(resp.shape[0], generator=g)
    rewards = torch.zeros(resp.shape[0], t)
    rewards[torch.arange(resp.shape[0]), response_mask.sum(1) - 1] = scores
    return {"input_ids": torch.cat([ids, resp], 1), "attention_mask": torch.cat([mask, response_mask], 1),
            "response_mask": response_mask, "token_level_rewards": rewards}


def compute_step(model, batch: dict[str, torch.Tensor], step: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Log-probs, advantages, one policy update; returns (tensors, scalars). The model is updated in place."""
    T = batch["response_mask"].shape[1]
    ids, am, rm = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    with torch.no_grad():
        old, ent = compute_logprobs(model, ids, am, T, temperature=step["temperature"], with_entropy=True)
    index = [i // step["samples"] for i in range(ids.shape[0])]
    adv, _ = algo.compute_advantage(step["adv_estimator"], token_level_rewards=batch["token_level_rewards"].to(old),
                                    response_mask=rm, index=index)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    logp, _ = compute_logprobs(model, ids, am, T, temperature=step["temperature"])
    loss, _ = algo.get_policy_loss(step["policy_loss"])(old, logp, adv, rm, step["loss_agg_mode"],
                                                       {"clip_ratio": step["clip_ratio"], "global_batch_info": {}})
    model.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, step["max_grad_norm"])
    torch.optim.SGD(params, lr=step["lr"]).step()
    model.eval()
    with torch.no_grad():
        new, _ = compute_logprobs(model, ids, am, T, temperature=step["temperature"])
    names = [n for n, _ in model.named_parameters()]
    params_by_name = dict(model.named_parameters())
    tensors = {
        "old_log_probs": old, "entropy": ent, "advantages": adv, "new_log_probs": new,
        "weight_sum": torch.stack([params_by_name[n].detach().double().sum() for n in names]),
        "weight_norm": torch.stack([params_by_name[n].detach().double().norm() for n in names]),
        "update_norm": torch.stack([(params_by_name[n].detach().double() - before[n].double()).norm() for n in names]),
    }
    return {k: v.detach().to("cpu", torch.float32) for k, v in tensors.items()}, {
        "pg_loss": float(loss.detach()), "grad_norm": float(grad_norm), "param_names": names}


def record_golden(out_dir, backend: Backend, seed: int = 0) -> Path:
    """Record the golden step on ``backend`` in float32 into ``out_dir`` (written atomically; an ``out_dir`` that
    holds something is never replaced: portrl.outputs.publish). Returns where it went."""
    out = Path(out_dir)
    step = {**STEP, "seed": seed}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_tiny_model(tmp / "model", seed=seed)
        tokenizer = load_tokenizer(tmp / "model")
        model = load_causal_lm(tmp / "model", dtype="float32", backend=backend, device=backend.device())
        model.eval()
        batch = {k: v.to(backend.device()) for k, v in _sample_batch(model, tokenizer, step).items()}
        tensors, scalars = compute_step(model, batch, step)
        save_file({k: v.cpu().contiguous() for k, v in batch.items()}, str(tmp / "batch.safetensors"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "expected.safetensors"))
        write_json(tmp / "golden.json", {"kind": "golden", "version": GOLDEN_VERSION, "step": step, **scalars,
                                         "recorded_on": environment(backend), "dtype": "float32"})
        os.chmod(tmp, 0o755)
        out = publish(tmp, out)  # claimed by the caller; never replaces a folder that appeared meanwhile
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_golden(golden_dir) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(golden.json, batch tensors, expected tensors), with a clear error for a missing or foreign dir."""
    d = Path(golden_dir)
    need = ["golden.json", "batch.safetensors", "expected.safetensors", "model/config.json"]
    missing = [n for n in need if not (d / n).exists()]
    if missing:
        raise FileNotFoundError(f"{str(d)!r} is not a golden written by `portrl parity record`: missing {missing}")
    meta = json.loads((d / "golden.json").read_text())
    if meta.get("kind") != "golden" or meta.get("version") != GOLDEN_VERSION:
        raise ValueError(f"{str(d)!r}: golden version {meta.get('version')!r}, this portrl reads {GOLDEN_VERSION}; "
                         "record it again with `portrl parity record`")
    return meta, load_file(str(d / "batch.safetensors")), load_file(str(d / "expected.safetensors"))


def replay_golden(golden_dir, backend: Backend, dtype: str = "float32") -> dict[str, Any]:
    """Recompute the golden step on ``backend`` in ``dtype``; a report with per-quantity metrics and verdict."""
    meta, batch, expected = read_golden(golden_dir)
    step = meta["step"]
    backend.manual_seed(step["seed"])
    device = backend.device()
    model = load_causal_lm(Path(golden_dir) / "model", dtype=dtype, backend=backend, device=device)
    model.eval()
    tensors, scalars = compute_step(model, {k: v.to(device) for k, v in batch.items()}, step)
    if scalars["param_names"] != meta["param_names"]:
        raise ValueError("the replayed model's parameters differ from the golden's; was the model dir edited?")
    checks = {k: compare_tensors(tensors[k], expected[k], dtype) for k in expected}
    for k in ("pg_loss", "grad_norm"):
        checks[k] = compare_tensors(torch.tensor(scalars[k]), torch.tensor(meta[k]), dtype)
    return {"kind": "replay", "golden": str(golden_dir), **environment(backend), "dtype": dtype,
            "recorded_on": meta["recorded_on"], "checks": checks,
            "verdict": worst(c["verdict"] for c in checks.values()),
            "values": {"pg_loss": [scalars["pg_loss"], meta["pg_loss"]],
                       "grad_norm": [scalars["grad_norm"], meta["grad_norm"]]}}
