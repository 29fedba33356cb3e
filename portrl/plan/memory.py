"""Each phase's peak memory per device, predicted from the model's shape, the mesh, the dtypes and the step's sizes.

A phase's peak is what stays on the device through the run (the *state*) plus what the phase allocates while
it runs (its *work*), as a device's ``max_memory_allocated`` counts it (the CPU: backends/cpu/heap.py)::

    state   = weights + masters + AdamW moments + reference copy + critic + recorded rollout forward
    gen     = state + the engine's share (hf: KV cache and the copy made while rows are repeated or dropped,
              fused q/k/v and gate/up weights, prefill workspace;
              an engine that reserves memory up front: rollout.gpu_memory_utilization x device memory)
    logp    = state + one micro-batch's forward without gradients (its logits, per chunk when chunked)
    ref     = the same through the reference (with a reference)
    update  = state + gradients + one micro-batch's saved activations and logits

with, per device (``S``: the ranks a weight is split over, FSDP group x tensor parallel; ``P``: parameters)::

    weights  P b / S      b: the compute dtype's bytes (FSDP keeps float32 shards and gathers one layer at a time)
    masters  4 P / S      only when computing in a 16-bit dtype without FSDP (portrl.workers.master_weights)
    moments  8 P_t / S    AdamW's two float32 moments of the trainable parameters, allocated with the optimizer
    grads    4 P_t / S    (without FSDP in a 16-bit dtype: b P_t / S in backward, then the masters' 4 P_t / S)
    ref      P b / tp     the reference policy: under FSDP a whole copy on every rank (portrl.workers.actor._plain_copy)
    tape     (prompts x prompt_len + rows x (response_len - 1)) x (q+k+v + o + gate+up + down widths) x L x b
             the hf engine's recording of the rollout's matmuls, kept until the update replays it
             (portrl.models.forward_tape.tape_nbytes; on only where portrl.workers.actor records)
    engine_weights  P b   under FSDP, the colocated hf engine's full copy of the policy

Offload (``Layout.offload``, portrl.workers.offload; on an accelerator only: on the CPU the host is the device)
takes a state term out of every phase but those that read it (:data:`HELD`): the float32 shards under FSDP
(read by the old log-probs and the update) or a 16-bit run's masters (read by the update), AdamW's moments (the
update), the reference (its own pass), the critic's alike (values, its update). Activation offload leaves a
training micro-batch one layer's saved tensors on the device (the layer backward is at; the rest wait on the host).

An activation's bytes per token and layer are counted from the layer's tensors autograd keeps (see
:func:`activation_bytes_per_token`); the logits' from the vocabulary and the element size the code path really
holds them in (float32: the log-prob op upcasts). What is measured against these figures, and how close they are,
is benchmarks/memory_plan.py's table and tests/test_plan_memory.py's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from portrl.ops.logprobs import CHUNK_ELEMENTS
from portrl.rollout.decode_rows import COMPACT_FRACTION
from portrl.plan.shape import ModelShape

#: bytes of a float32 element (master weights, AdamW moments, gradients of the masters, logits)
F32 = 4
#: bytes per element of each training dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Workload:
    """The sizes one device handles in one step (the preflight's from the config's maxima, a running step's from
    its batch): ``prompts`` distinct prompts of ``n`` rows each, the longest prompt and response; ``micro_tokens``:
    the most tokens one training micro-batch runs (a shared prompt once); ``response_tokens_micro``: its response
    tokens (the positions whose logits are kept); ``inference_*``: the same of a no-grad pass's micro-batch."""

    prompts: int
    n: int
    prompt_len: int
    response_len: int
    micro_tokens: int
    response_tokens_micro: int
    inference_tokens: int = 0
    response_tokens_inference: int = 0
    compacts: bool = True  # the hf engine drops finished rows from its cache mid-generation (a copy of the cache)

    @property
    def rows(self) -> int:
        return self.prompts * self.n


@dataclass(frozen=True)
class Layout:
    """How the run holds its models on one device."""

    dtype_bytes: int  # the compute dtype's element size
    shards: int = 1  # ranks a weight is split over (FSDP group x tensor parallel)
    tensor_parallel: int = 1
    sequence_parallel: int = 1
    fsdp: bool = False
    checkpointing: bool = False
    reference: bool = False
    critic: bool = False
    tape: bool = False  # the hf engine records the rollout's forward for the update to replay
    tape_cap: int | None = None  # the most a recording may hold (under checkpointing); None: no bound
    engine: str = "hf"  # hf: portrl's own (memory as it goes); reserving: an engine taking a share up front
    fast_decode: bool = True  # the hf engine decodes on its own cache, allocated whole (portrl.rollout.fast_decode)
    engine_reserve: int = 0  # bytes an up-front engine takes (utilization x device memory)
    logprob_chunk: int | None = None  # tokens per chunk of the log-prob op; None: all of a micro-batch at once
    trainable: int | None = None  # parameters trained (LoRA: the adapters'); None: all of them
    # parts kept in host memory between the calls that read them: params, optimizer, activations, reference,
    # critic_params, critic_optimizer, critic_activations (portrl.workers.offload)
    offload: frozenset[str] = frozenset()


@dataclass
class PhasePeak:
    """One phase's predicted peak bytes per device and the terms that make it (name -> bytes)."""

    phase: str
    terms: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.terms.values())


def lora_params(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """Parameters of LoRA adapters of ``rank`` on the ``targets`` modules of every layer: ``r (in + out)`` each (the
    A and B matrices); ``embed_tokens`` and ``lm_head`` once, ``r (V + h)``."""
    h, a, k, d, i = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    dims = {"q_proj": (h, a * d), "k_proj": (h, k * d), "v_proj": (h, k * d), "o_proj": (a * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    per_layer = sum(rank * sum(dims[t]) for t in targets if t in dims)
    once = sum(rank * (shape.vocab + h) for t in targets if t in ("embed_tokens", "lm_head"))
    return shape.layers * per_layer + once


def tape_bytes(shape: ModelShape, w: Workload, dtype_bytes: int) -> int:
    """portrl.models.forward_tape.tape_nbytes from the shape: slots x the four recorded widths x layers x b."""
    a, k, d = shape.heads, shape.kv_heads, shape.head_dim
    widths = (a * d + 2 * k * d) + shape.hidden + 2 * shape.intermediate + shape.hidden
    slots = w.prompts * w.prompt_len + w.rows * max(w.response_len - 1, 0)
    return slots * widths * shape.layers * dtype_bytes


def activation_bytes_per_token(shape: ModelShape, dtype_bytes: int, checkpointing: bool) -> int:
    """Bytes one token's saved activations take over all layers in a training forward.

    Without checkpointing, a layer keeps (elements per token): its input and the attention's (the two norms'
    inputs and outputs, 4h), q, k and v before and after rotary (2 (a d + 2 k d)), the attention output (a d),
    the gate and up projections, SiLU(gate) and the product (4 i), plus float32 norm statistics (ignored).
    With checkpointing a layer keeps its input only (h), and the one layer being recomputed holds the full set.
    """
    full = _layer_saved(shape)
    if checkpointing:
        return (shape.layers * shape.hidden + full) * dtype_bytes
    return shape.layers * full * dtype_bytes


def _layer_saved(shape: ModelShape) -> int:
    """Elements per token one layer's training forward saves (:func:`activation_bytes_per_token`)."""
    a, k, d, h, i = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    return 4 * h + 2 * (a * d + 2 * k * d) + a * d + 4 * i


#: a state term -> (the offload part that moves it, the phases that read it); ``weights`` and ``critic`` move only
#: under FSDP (the float32 shards; otherwise they are the compute copy the engine and the no-grad passes read)
HELD = {"weights": ("params", ("logp", "update_actor")), "master_weights": ("params", ("update_actor",)),
        "adamw_moments": ("optimizer", ("update_actor",)), "reference": ("reference", ("ref",)),
        "critic": ("critic_params", ("values", "update_critic")),
        "critic_masters": ("critic_params", ("update_critic",)),
        "critic_adamw": ("critic_optimizer", ("update_critic",))}


def _state(shape: ModelShape, lay: Layout) -> dict[str, int]:
    p, b, s = shape.params, lay.dtype_bytes, lay.shards
    trainable = p if lay.trainable is None else lay.trainable
    weights = p * (F32 if lay.fsdp else b) // s
    terms = {"weights": weights, "adamw_moments": 2 * F32 * trainable // s}
    if b < F32 and not lay.fsdp:
        terms["master_weights"] = F32 * trainable // s
    if lay.fsdp and lay.engine == "hf":  # FSDP shards the policy in place: the engine decodes a copy of its own
        terms["engine_weights"] = p * b // lay.tensor_parallel
    if lay.reference:  # a deep copy keeps tensor-parallel shards; under FSDP it is loaded whole
        terms["reference"] = p * b // (1 if lay.fsdp else lay.tensor_parallel)
    if lay.critic:  # a critic of the policy's shape (value head: one row instead of the vocabulary)
        terms.update(critic=weights, critic_adamw=2 * F32 * p // s)
        if b < F32 and not lay.fsdp:
            terms["critic_masters"] = F32 * p // s
    return terms


def _resident(state: dict[str, int], phase: str, lay: Layout) -> dict[str, int]:
    """The state terms on the device during ``phase``: offloaded parts only where the phase reads them."""
    out = {}
    for term, size in state.items():
        part, readers = HELD.get(term, ("", ()))
        moves = part in lay.offload and (lay.fsdp or term not in ("weights", "critic"))
        if not moves or phase in readers:
            out[term] = size
    return out


def _gen_work(shape: ModelShape, w: Workload, lay: Layout) -> dict[str, int]:
    if lay.engine != "hf":
        return {"engine_reserve": lay.engine_reserve}
    b = lay.dtype_bytes
    kv = w.rows * (w.prompt_len + w.response_len) * shape.kv_bytes_per_token * b // lay.tensor_parallel
    # the cache is copied while the old one lives: the prompts' rows repeated n times after the prefill (1/n of it
    # beside the whole), then each drop of finished rows (the rows kept beside the whole)
    copy = max(1 / w.n if w.n > 1 else 0.0, 1 - COMPACT_FRACTION if w.compacts and w.response_len > 1 else 0.0)
    copy = copy if lay.fast_decode else 0.0  # transformers' own cache grows a step at a time instead
    a, k, d, h, i = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    fused = shape.layers * (h * (a * d + 2 * k * d) + 2 * h * i) * b
    prefill = w.prompts * w.prompt_len * (h + a * d + 2 * k * d + 2 * i) * b
    logits = w.rows * shape.vocab * F32
    return {"kv_cache": kv, "kv_cache_copy": int(kv * copy), "fused_weights": fused, "prefill_work": prefill,
            "step_logits": logits}


def _logits_bytes(shape: ModelShape, positions: int, lay: Layout) -> int:
    """The log-prob op's float32 logits and their log-softmax (or gradient, in backward) at a micro-batch's
    response ``positions``, a chunk of rows at a time: ``model.logprob_chunk_size``, else the op's default of about
    CHUNK_ELEMENTS logits (portrl.ops.logprobs; a backend kernel that holds less is counted on the safe side)."""
    vocab = shape.vocab // lay.tensor_parallel
    chunk = lay.logprob_chunk or max(1, CHUNK_ELEMENTS // max(vocab, 1))
    return 2 * min(chunk, positions) * vocab * F32


def _no_grad_work(shape: ModelShape, w: Workload, lay: Layout) -> dict[str, int]:
    """A forward without gradients over a no-grad micro-batch: the residual stream and one layer's widest
    intermediates (its input, the normed copy, gate, up and their product: ``2 h + 3 i`` per token), and the
    response positions' logits."""
    tokens = w.inference_tokens // lay.sequence_parallel
    width = 2 * shape.hidden + 3 * shape.intermediate // lay.tensor_parallel
    return {"layer_work": tokens * width * lay.dtype_bytes,
            "logits": _logits_bytes(shape, w.response_tokens_inference // lay.sequence_parallel, lay)}


def plan_phases(shape: ModelShape, w: Workload, lay: Layout) -> list[PhasePeak]:
    """The peaks of ``gen``, ``logp`` (old log-probs), ``ref`` (with a reference), ``update_actor``, and with a
    critic ``values`` and ``update_critic``, per device."""
    state = _state(shape, lay)
    if lay.tape:
        recording = tape_bytes(shape, w, lay.dtype_bytes)
        state["rollout_recording"] = recording if lay.tape_cap is None else min(recording, lay.tape_cap)
    trainable = shape.params if lay.trainable is None else lay.trainable
    logits = _logits_bytes(shape, w.response_tokens_micro // lay.sequence_parallel, lay)
    work = {"gen": _gen_work(shape, w, lay), "logp": _no_grad_work(shape, w, lay)}
    if lay.reference:
        work["ref"] = work["logp"]
    work["update_actor"] = _update_work(trainable, _activations(shape, w, lay, "activations"), logits, lay)
    if lay.critic:
        work["values"] = {"layer_work": work["logp"]["layer_work"]}
        work["update_critic"] = _update_work(trainable, _activations(shape, w, lay, "critic_activations"), 0, lay)
    return [PhasePeak(phase, {**_resident(state, phase, lay), **terms}) for phase, terms in work.items()]


def _activations(shape: ModelShape, w: Workload, lay: Layout, part: str) -> int:
    """A training micro-batch's saved activations on the device; with ``part`` offloaded, one layer's."""
    if part in lay.offload:
        per_token = _layer_saved(shape) * lay.dtype_bytes
    else:
        per_token = activation_bytes_per_token(shape, lay.dtype_bytes, lay.checkpointing)
    return w.micro_tokens // lay.sequence_parallel * per_token // lay.tensor_parallel


def _update_work(trainable: int, acts: int, logits: int, lay: Layout) -> dict[str, int]:
    """A training micro-batch's work: its activations, logits and the gradients. In a 16-bit dtype without FSDP
    the backward fills the compute copy's gradients (``b P_t``), which the step then turns into float32 masters'
    gradients one tensor at a time (portrl.workers.master_weights.grads_to_masters): the larger of the two."""
    backward = {"gradients": F32 * trainable // lay.shards, "activations": acts, "logits": logits}
    if lay.dtype_bytes >= F32 or lay.fsdp:
        return backward
    backward["gradients"] = lay.dtype_bytes * trainable // lay.shards
    step = {"master_gradients": F32 * trainable // lay.shards}
    return backward if sum(backward.values()) >= sum(step.values()) else step
