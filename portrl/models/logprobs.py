"""Log-probabilities (and entropy) of response tokens under a causal LM, on packed sequences.

Batch layout (verl): ``input_ids (B, P+T)`` = left-padded prompt + right-padded response,
``attention_mask (B, P+T)``; the response is the last ``T = response_length`` columns. The token
in column ``j`` is scored by the final hidden state of column ``j - 1``::

    logp[b, t] = log softmax(h[b, P+t-1] W^T / temperature)[input_ids[b, P+t]]

Packed (default): padding is removed, the B rows are concatenated into one row of N tokens with
position_ids restarting at 0 for each sequence and ``cu_seq_lens_q/k`` passed to the attention, so
no compute is spent on padding. The LM head never produces full logits: only the hidden states that
score response tokens go through the ``logprobs_entropy`` op (chunked, with its own backward).
Positions where the response is padding get 0.

``share_prompts`` (packed, with a portrl attention implementation): rows whose prompts are equal
run their prompt once and skip each response's last token
(:mod:`portrl.models.prefix_sharing`); same log-probs and gradients, fewer tokens through the
linear layers.
"""

from __future__ import annotations

import logging

import torch

from portrl.models.attention import PREFIX
from portrl.models import forward_tape
from portrl.models.multimodal import is_vision_language, vl_response_hidden_states
from portrl.models.prefix_sharing import PLAN_KWARG, plan_shared_prompts
from portrl.models.sequence_parallel import SEQUENCE_GROUP_ATTR, SEQUENCE_GROUP_KWARG, gather_tokens, shard_tokens
from portrl.models.tensor_parallel import vocab_shard
from portrl.ops.attention import cu_seqlens_from_lengths
from portrl.ops.logprobs_tp import vocab_parallel_logprobs_entropy
from portrl.ops.logprobs import default_chunk_size, logprobs_entropy


def _decoder_and_head(model):
    """(base decoder returning final-normed hidden states, LM head Linear) of a CausalLM (or a PEFT wrapper)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(inner, inner.base_model_prefix, None)
    head = inner.get_output_embeddings()
    if base is None or head is None:
        raise TypeError(f"{type(inner).__name__} is not a causal LM with a base model and an output embedding")
    return inner, base, head


_warned: set = set()


def _log_once(level: int, message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).log(level, message)


def _warn_once(message: str) -> None:
    _log_once(logging.WARNING, message)


def _attention_layers(base) -> int:
    """How many attention calls one forward of the decoder makes (its number of layers)."""
    layers = getattr(base, "layers", None)
    return len(layers) if layers is not None else int(getattr(base.config, "num_hidden_layers", 1))


def _reads_shared_plan(model) -> bool:
    """True when the model's attention is a portrl implementation (the one that reads the shared-prompt plan)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return impl.startswith(PREFIX + "_")


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Remove padding: ``(flat_ids (N,), position_ids (N,), cu_seqlens int32 (B+1,), max_len, flat_index (B, L))``
    where ``flat_index[b, j]`` is column j's row in the packed tokens (meaningful where the mask is 1)."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    flat_index = mask.reshape(-1).cumsum(0).reshape(mask.shape) - 1
    position_ids = (mask.cumsum(1) - 1)[mask]
    return input_ids[mask], position_ids, cu_seqlens_from_lengths(lengths), int(lengths.max()), flat_index


def response_hidden_states(base, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                           packed: bool = True, share_prompts: bool = True, tape=None):
    """``(hidden (n, H), resp_valid (B, T) bool)``: the decoder's final hidden state that scores each real
    response token (column ``P+t-1`` for token ``P+t``), in row-major order of ``resp_valid``.

    ``base`` is the decoder (returns ``last_hidden_state``). Layouts: shared prompts (packed, when
    ``share_prompts`` and the attention is portrl's), packed rows, or the padded batch. ``tape`` (a
    :class:`portrl.models.forward_tape.ForwardTape`): with shared prompts, replay the rollout's recorded
    matmuls when the tape holds every row and ``base``'s weights have not changed since; else ignored.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids and attention_mask must both be (B, P+T); got {tuple(input_ids.shape)} and "
                         f"{tuple(attention_mask.shape)}")
    batch, length = input_ids.shape
    T = int(response_length)
    if not 0 < T < length:
        raise ValueError(f"response_length must be in [1, {length - 1}] for sequences of length {length}; got {T}")
    mask = attention_mask.bool()
    resp_valid = mask[:, length - T:]
    if not bool(mask[:, length - T - 1:length - 1][resp_valid].all()):
        raise ValueError("every response token must follow an unmasked token (is the prompt left-padded and non-empty?)")
    layout = None
    sp_group = getattr(base, SEQUENCE_GROUP_ATTR, None)
    if sp_group is not None:
        if not packed:
            raise ValueError("sequence parallelism runs packed rows only (model.use_packing=true)")
        return _sequence_parallel_hidden(base, input_ids, attention_mask, T, sp_group), resp_valid
    if packed and share_prompts and _reads_shared_plan(base):
        layout = plan_shared_prompts(input_ids, attention_mask, T)
    if layout is not None and tape is not None and tape.usable(base):
        slots = tape.positions(input_ids, attention_mask, T)
        if slots is not None:
            hidden = forward_tape.replay_hidden_states(base, tape, layout, slots.reshape(-1)[layout.src])
            return hidden[layout.score_rows], resp_valid
    if layout is not None:
        try:
            out = base(input_ids=layout.flat_ids[None], position_ids=layout.position_ids[None], use_cache=False,
                       **{PLAN_KWARG: layout.plan})
        except TypeError as exc:  # a forward without **kwargs
            if PLAN_KWARG not in str(exc):
                raise
            out = None
        if out is not None and layout.plan.reads >= _attention_layers(base):
            return out.last_hidden_state[0][layout.score_rows], resp_valid
        # some layer never saw the plan (a transformers version that drops unknown keywords on the way to
        # the attention): its output is not that of separate sequences, so run the plain packed layout
        _warn_once("the model's attention did not receive the shared-prompt plan in every layer; using plain "
                   "packing (set model.share_prompts=false to skip the attempt)")
    if packed:
        flat_ids, position_ids, cu, max_len, flat_index = pack_rows(input_ids, attention_mask)
        out = base(input_ids=flat_ids[None], position_ids=position_ids[None], use_cache=False,
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        hidden = out.last_hidden_state[0]
    else:
        position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state.reshape(batch * length, -1)
        flat_index = torch.arange(batch * length, device=input_ids.device).reshape(batch, length)
    return hidden[flat_index[:, length - T - 1:length - 1][resp_valid]], resp_valid


def _sequence_parallel_hidden(base, input_ids, attention_mask, response_length: int, group) -> torch.Tensor:
    """The packed layout of :func:`response_hidden_states` run as Ulysses sequence parallelism over ``group``
    (portrl.models.sequence_parallel): this rank's slice of the packed row through the decoder, every rank's
    slices gathered back into the whole row."""
    flat_ids, position_ids, cu, max_len, flat_index = pack_rows(input_ids, attention_mask)
    part = shard_tokens(flat_ids, position_ids, cu, max_len, group)
    out = base(input_ids=part.input_ids[None], position_ids=part.position_ids[None], use_cache=False,
               cu_seq_lens_q=part.cu_seqlens, cu_seq_lens_k=part.cu_seqlens, max_length_q=part.max_len,
               max_length_k=part.max_len, **{SEQUENCE_GROUP_KWARG: group})
    hidden = gather_tokens(out.last_hidden_state[0], group)
    length = input_ids.shape[1]
    resp_valid = attention_mask.bool()[:, length - response_length:]
    return hidden[flat_index[:, length - response_length - 1:length - 1][resp_valid]]


def compute_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                     temperature: float = 1.0, with_entropy: bool = False, packed: bool = True,
                     chunk_size: int | None = None, share_prompts: bool = True, tape=None,
                     with_sum_pi_squared: bool = False, multi_modal=None):
    """``(logp (B, T), entropy (B, T) or None)`` of the response tokens, float32, differentiable.

    ``packed=False`` runs the padded batch instead (position_ids = cumsum(mask) - 1); same result.
    ``share_prompts`` (packed only) computes each distinct prompt once when the model's attention is
    one of portrl's (``portrl_*``, which reads the shared-prompt plan); other attention falls back to
    plain packing. ``tape``: see :func:`response_hidden_states`.
    The log-prob kernel is the one :func:`portrl.models.load_causal_lm` selected, else native.
    ``with_sum_pi_squared``: a third value, ``Σ_v π(v)²`` (B, T) of every response token's distribution
    (:func:`sum_pi_squared`, no gradient), for the optimal-token-baseline estimators; 0 at padding.
    Vision-language models (:mod:`portrl.models.multimodal`): ``multi_modal`` is the batch's image inputs
    (``pixel_values``, ``image_grid_thw`` of its rows in order; None for text rows only); shared prompts and the
    tape are not used for them.
    """
    inner, base, head = _decoder_and_head(model)
    fn = getattr(inner, "portrl_logprobs_entropy", None) or logprobs_entropy
    if is_vision_language(inner):
        if share_prompts or tape is not None:
            _log_once(logging.INFO, "vision-language model: log-probs run plain packed rows (shared prompts and the rollout's "
                       "forward replay are off: different images can share token ids)")
        hidden, resp_valid = vl_response_hidden_states(base, input_ids, attention_mask, response_length, packed,
                                                       multi_modal)
    else:
        if multi_modal is not None:
            raise ValueError(f"{type(inner).__name__} is a text model; it cannot take image inputs")
        hidden, resp_valid = response_hidden_states(base, input_ids, attention_mask, response_length, packed,
                                                    share_prompts, tape)
    labels = input_ids[:, input_ids.shape[1] - resp_valid.shape[1]:][resp_valid]
    bias = getattr(head, "bias", None)
    shard = vocab_shard(head)
    if shard is not None:  # tensor parallel: this rank's rows of the head, never the full logits
        if with_sum_pi_squared:
            raise ValueError("the optimal-token baseline's sum of squared probabilities is not computed under tensor "
                             "parallelism (actor.tensor_parallel_size > 1)")
        logp_v, ent_v = vocab_parallel_logprobs_entropy(hidden, shard.weight, labels, shard.vocab_start, shard.group,
                                                        temperature, shard.bias, chunk_size)
    else:
        logp_v, ent_v = fn(hidden, head.weight, labels, temperature, bias, chunk_size)
    zeros = torch.zeros(resp_valid.shape, dtype=logp_v.dtype, device=logp_v.device)
    logp = zeros.index_put((resp_valid,), logp_v)
    entropy = zeros.index_put((resp_valid,), ent_v) if with_entropy else None
    if not with_sum_pi_squared:
        return logp, entropy
    spi = sum_pi_squared(hidden, head.weight, temperature, bias, chunk_size)
    return logp, entropy, zeros.index_put((resp_valid,), spi.to(zeros.dtype))


@torch.no_grad()
def sum_pi_squared(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0,
                   bias: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """``Σ_v softmax(z_n)_v²`` (N,) for logits ``z = (h W^T + b) / temperature``, in at least float32, as
    ``exp(logsumexp(2z) − 2·logsumexp(z))`` (stable for any logit scale). Rows go ``chunk_size`` at a time
    (default: the log-prob op's chunk), so the full (N, V) logits never exist; the LM head's matmul runs once more
    for these rows (the log-prob kernels keep no logits).
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = default_chunk_size(n, vocab) if chunk_size is None else max(1, int(chunk_size))
    compute = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.empty(n, dtype=compute, device=hidden.device)
    for s in range(0, n, chunk):
        z = torch.nn.functional.linear(hidden[s:s + chunk], weight, bias).to(compute)
        if temperature != 1.0:
            z.div_(float(temperature))
        lse = torch.logsumexp(z, dim=-1)
        out[s:s + chunk] = torch.exp(torch.logsumexp(z.mul_(2.0), dim=-1) - 2.0 * lse)
    return out
