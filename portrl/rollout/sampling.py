"""Next-token sampling in torch: temperature, top-k, top-p, and the sampled token's log-prob.

For logits ``z`` (rows, vocab) and temperature ``T > 0``:

* ``logp = z/T - logsumexp(z/T)`` at the sampled token (the convention of :mod:`portrl.rollout.types`:
  temperature applied, truncation not);
* top-k keeps the ``k`` largest ``z/T`` per row; top-p then keeps the smallest prefix of the sorted
  distribution whose mass reaches ``p`` (the most likely token is always kept);
* the token is drawn by inverse CDF: ``u ~ U(0, 1]`` from ``generator`` (one number per row), and
  the first token whose cumulative kept mass reaches ``u * total`` (without truncation ``exp(z/T - max)`` is
  computed once for both the draw and ``logsumexp = max + log(sum)``). One uniform per row is far
  cheaper on CPU than a vocabulary-sized noise tensor (Gumbel / exponential race). The weights are
  ``exp2(x * log2(e))`` (:func:`_exp_`): torch's CPU ``exp`` of a float tensor goes through the vector math library
  of torch's CPU build, which opens three OpenMP regions a call, each waking a sleeping thread, and takes ~150
  cycles an element whose result is subnormal (x < -87); ``exp2`` is torch's own vectorised loop. The product's
  rounding makes the weights differ from ``exp(x)`` by at most ~3e-7 relatively for x > -10 (4e-6 near -87); the
  sampled token's ``logp`` keeps the logit itself (the gain: docs/performance.md).

``T == 0`` is greedy: ``argmax(z)``, with ``logp = log_softmax(z)`` at that token.

Non-finite logits (a model whose weights diverged): a row with a NaN or infinite ``z`` gets a non-finite ``logp``
(its ``logsumexp`` is NaN or inf) and a token id that is still in the vocabulary (never an index error, which on a
GPU would be a device-side assert). A sampled token's ``logp`` is finite whenever its row's logits are, so the
decode loop checks ``logp`` in the host sync it makes anyway (:meth:`portrl.rollout.decode_rows.DecodeRows.record`)
and raises :class:`NonFiniteLogitsError`.
"""

from __future__ import annotations

import torch

from portrl.errors import UserError


LOG2E = 1.4426950408889634  # log2(e), the float nearest


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` in place as ``exp2(x * log2(e))`` (module docstring: why)."""
    return x.mul_(LOG2E).exp2_()


class NonFiniteLogitsError(UserError):
    """The policy's logits are NaN or infinite at decode step ``step`` (``rows`` rows of the batch): its weights
    diverged, or a checkpoint of diverged weights was loaded. The trainer turns it into its divergence stop
    (portrl.trainer.divergence), naming the last checkpoint to resume from."""

    def __init__(self, step: int, rows: int):
        self.step, self.rows = int(step), int(rows)
        super().__init__(f"the policy's logits are not finite (NaN or inf) at decode step {self.step} in "
                         f"{self.rows} row{'s' if self.rows != 1 else ''}: its weights diverged; resume from a "
                         f"checkpoint written before the divergence with a lower learning rate")

    def __reduce__(self):  # pickled across Ray by its arguments, not by its message
        return type(self), (self.step, self.rows)


def _truncate_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Return ``scaled`` with the tokens outside top-k / top-p set to -inf (a new tensor)."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # mass strictly before each token; a token is dropped once that mass already reaches top_p
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (rows, vocab). Returns ``(tokens (rows,) long, logp (rows,) float32)``;
    a row with non-finite logits gets an in-vocabulary token and a non-finite ``logp`` (module docstring)."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return tokens, logp
    scaled = logits / temperature if temperature != 1.0 else logits
    if 0 < top_k < scaled.shape[-1] or top_p < 1.0:
        lse = torch.logsumexp(scaled, dim=-1)
        cdf = _exp_(_truncate_top_k_top_p(scaled, top_k, top_p) - lse[:, None]).cumsum_(dim=-1)
    else:  # nothing truncated: one exp pass serves the log-sum-exp and the (unnormalised) cdf
        top = scaled.amax(dim=-1, keepdim=True)
        weights = _exp_(torch.sub(scaled, top))
        lse = (top + weights.sum(dim=-1, keepdim=True).log()).squeeze(-1)
        cdf = weights.cumsum_(dim=-1)
    # u in (0, total]: the first index with cdf >= u never lands on a zero-mass token (its cdf equals
    # the previous entry's) and never runs past the end.
    u = (1.0 - torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype)) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)  # past the end: a NaN cdf only
    logp = scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse
    return tokens, logp
