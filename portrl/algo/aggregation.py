"""Loss aggregation (verl ``agg_loss``) with global token / sequence counts.

For a per-token loss ``L (B,T)`` and mask ``m``: ``S_i = Σ_t L_it m_it``, ``n_i = Σ_t m_it``,
``v_i = [n_i > 0]``. With data parallelism each rank passes the *global* counts of the whole
mini-batch and ``dp_size``; summing micro-batch losses and averaging over ranks (what DDP does to
gradients) then gives exactly the loss of the whole mini-batch.

=========================  ====================================================================
mode                       value
=========================  ====================================================================
token-mean                 ``Σ_i S_i / N · dp``          N = batch_num_tokens or local Σ m
token-sum                  ``Σ_i S_i · dp``
seq-mean-token-sum         ``Σ_i v_i S_i / Bg · dp``     Bg = global_batch_size or local Σ v_i
seq-mean-token-mean        ``Σ_i v_i S_i/n_i / Bg · dp``
seq-mean-token-sum-norm    ``Σ_i v_i S_i / (Bg·K) · dp`` K = loss_scale_factor or T (Dr. GRPO)
=========================  ====================================================================

Token-mean is DAPO's token-level loss (Yu et al. 2025, arXiv 2503.14476); seq-mean-token-mean is the
GRPO paper's (Shao et al. 2024, arXiv 2402.03300); seq-mean-token-sum-norm is Dr. GRPO's
(Liu et al. 2025, arXiv 2503.20783). TRL's ``loss_type`` names are aliases (see ``trl_aliases``).

Decisions: ``dp_size > 1`` without the global count a mode needs is a ValueError (a local count
would silently change the loss); a zero denominator (an all-masked batch with local counts, or a
global count of 0) is a ValueError, never NaN. A shard that is all masked but has global counts is
fine and gives 0. With ``global_batch_size`` given, fully masked rows count in the denominator (the
engine path); with local counts they are excluded.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from portrl.algo.masked import as_bool_mask, compute_dtype
from portrl.algo.registry import LOSS_AGG_MODES

Number = Union[int, float, torch.Tensor]


def _count(x: Optional[Number], name: str) -> Optional[torch.Tensor]:
    if x is None:
        return None
    t = torch.as_tensor(x).detach()
    if t.numel() != 1:
        raise ValueError(f"agg_loss: {name} must be a scalar, got shape {tuple(t.shape)}")
    return t.reshape(())


def _div(num: torch.Tensor, den: torch.Tensor, what: str) -> torch.Tensor:
    if float(den) <= 0:
        raise ValueError(f"agg_loss: {what} is 0 (all-masked batch?); the loss would be NaN")
    return num / den.to(device=num.device, dtype=num.dtype)


def _parts(loss_mat: torch.Tensor, mask: torch.Tensor):
    if loss_mat.dim() != 2:
        raise ValueError(f"agg_loss: loss_mat must be (batch, response_length), got shape {tuple(loss_mat.shape)}")
    m = as_bool_mask(mask, loss_mat, "mask")
    x = loss_mat if loss_mat.dtype in (torch.float32, torch.float64) else loss_mat.to(compute_dtype(loss_mat))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    seq_sum = torch.where(m, x, zero).sum(dim=-1)
    n_tok = m.sum(dim=-1)
    return m, seq_sum, n_tok


def _need_global(value, name: str, dp_size: int, mode: str) -> None:
    if value is None and dp_size > 1:
        raise ValueError(f"agg_loss: mode {mode!r} with dp_size={dp_size} needs {name} (the global count); "
                         f"a per-rank count would change the loss")


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    _need_global(batch_num_tokens, "batch_num_tokens", dp_size, "token-mean")
    m, seq_sum, n_tok = _parts(loss_mat, mask)
    n = _count(batch_num_tokens, "batch_num_tokens")
    n = n_tok.sum() if n is None else n
    return _div(seq_sum.sum(), n, "the token count") * dp_size


@LOSS_AGG_MODES.register("token-sum")
def _token_sum(loss_mat, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    _, seq_sum, _ = _parts(loss_mat, mask)
    return seq_sum.sum() * dp_size


def _seq_mean(seq_loss, n_tok, dp_size, global_batch_size, mode):
    _need_global(global_batch_size, "global_batch_size", dp_size, mode)
    valid = n_tok > 0
    total = torch.where(valid, seq_loss, torch.zeros((), dtype=seq_loss.dtype, device=seq_loss.device)).sum()
    bg = _count(global_batch_size, "global_batch_size")
    bg = valid.sum() if bg is None else bg
    return _div(total, bg, "the sequence count") * dp_size


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    _, seq_sum, n_tok = _parts(loss_mat, mask)
    return _seq_mean(seq_sum, n_tok, dp_size, global_batch_size, "seq-mean-token-sum")


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    _, seq_sum, n_tok = _parts(loss_mat, mask)
    seq_mean = seq_sum / n_tok.clamp(min=1).to(seq_sum.dtype)
    return _seq_mean(seq_mean, n_tok, dp_size, global_batch_size, "seq-mean-token-mean")


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    _, seq_sum, n_tok = _parts(loss_mat, mask)
    k = _count(loss_scale_factor, "loss_scale_factor")
    k = torch.tensor(float(loss_mat.shape[-1])) if k is None else k
    if float(k) <= 0:
        raise ValueError(f"agg_loss: loss_scale_factor must be > 0, got {float(k)}")
    return _seq_mean(seq_sum, n_tok, dp_size, global_batch_size, "seq-mean-token-sum-norm") / k.to(
        device=seq_sum.device, dtype=seq_sum.dtype)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[Number] = None,
    global_batch_size: Optional[Number] = None,
    loss_scale_factor: Optional[Number] = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``(B,T)`` to a scalar with ``mode`` (table in the module docstring).

    ``mode`` may be a TRL loss name (``grpo``, ``bnpo``, ``dapo``, ``dr_grpo``), resolved as an alias.
    Low-precision losses are aggregated in float32.
    """
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"agg_loss: dp_size must be an int >= 1, got {dp_size!r}")
    fn = LOSS_AGG_MODES.get(mode)
    return fn(loss_mat, mask, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
              global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)


def global_info(config) -> dict:
    """The ``global_batch_info`` mapping of a loss config as ``agg_loss`` keyword arguments."""
    info = None
    if config is not None:
        info = config.get("global_batch_info", None) if hasattr(config, "get") else None
    info = dict(info or {})
    allowed = {"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"}
    unknown = set(info) - allowed
    if unknown:
        raise ValueError(f"global_batch_info has unknown keys {sorted(unknown)}; valid: {sorted(allowed)}")
    if info.get("dp_size") is None:
        info.pop("dp_size", None)
    else:
        info["dp_size"] = int(info["dp_size"])
    return info
