"""Tensor parallelism of a causal LM with torch's ``parallelize_module`` plans over the "tp" dimension of a mesh.

Each decoder layer (Megatron's split, one all-reduce after attention and one after the MLP):

* ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``, ``mlp.gate_proj`` / ``up_proj``: column-wise (``ColwiseParallel``):
  rank ``r`` holds output rows ``[r O/tp, (r+1) O/tp)`` of the weight (and bias), so it computes its own
  ``H/tp`` query heads, ``Hkv/tp`` key/value heads and ``I/tp`` MLP channels from the replicated hidden state;
* ``self_attn.o_proj``, ``mlp.down_proj``: row-wise (``RowwiseParallel``): the rank's input columns, partial sums
  all-reduced into the replicated hidden state;
* the token embedding: vocabulary-parallel (row-wise on ``nn.Embedding``: rank ``r`` holds token rows
  ``[r V/tp, (r+1) V/tp)``, looks up the ids it owns, zeros elsewhere, all-reduced);
* the LM head: the same vocabulary rows (column-wise on the head; a tied head is re-tied to the sharded
  embedding). Its forward is never run in training: portrl.models.logprobs reads the rank's rows through
  :func:`vocab_shard` and computes log-probs and entropy with portrl.ops.logprobs_tp, which never gathers the
  full logits.

LoRA adapters (peft) on the decoder's linear layers split with them (:func:`_layer_plan`); on the embedding or the
head they cannot, and are refused.

Norms and the rotary embedding stay plain, replicated tensors: every rank computes them on the same input, so
their gradients are equal on every rank without a collective (the column-wise layers' input gradient, a partial
sum, is all-reduced by DTensor before it reaches them).

Families (``config.model_type``): Qwen2 / Qwen2.5 (``qwen2``), Llama (``llama``), and the language model of
Qwen2.5-VL (``qwen2_5_vl``: its vision tower stays replicated). Attention modules reshape with ``-1`` heads, so
they run on the rank's heads unchanged. Sizes are checked before any model loads (portrl.device.mesh_shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

#: the model families (``config.model_type``) with a plan
SUPPORTED = ("qwen2", "llama", "qwen2_5_vl")

_LAYER_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
               "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
               "mlp.down_proj": "rowwise"}


def _layer_plan(layer: nn.Module) -> dict[str, str]:
    """The decoder layer's plan: :data:`_LAYER_PLAN`, where a linear layer carrying LoRA adapters (peft's
    ``base_layer``, ``lora_A``, ``lora_B``) splits as one linear map ``W + s B A``: column-wise, ``base_layer``
    and each ``lora_B`` split their output rows and ``lora_A`` stays whole on every rank; row-wise,
    ``base_layer`` and each ``lora_A`` split their input columns (``A x``, a sum over them, is all-reduced into
    the replicated rank-``r`` activations) and ``lora_B`` stays whole. The replicated adapters see the same
    input and output gradient on every rank, so their gradients are equal without a collective."""
    plan: dict[str, str] = {}
    for name, kind in _LAYER_PLAN.items():
        linear = layer.get_submodule(name)
        if not hasattr(linear, "lora_A"):
            plan[name] = kind
            continue
        plan[f"{name}.base_layer"] = kind
        part = "lora_B" if kind == "colwise" else "lora_A"
        adapters: Any = getattr(linear, part)  # a ModuleDict: adapter name -> nn.Linear
        plan.update({f"{name}.{part}.{adapter}": kind for adapter in adapters})
    return plan


def _text_decoder(model: nn.Module) -> Any:
    """The text decoder in ``model`` (the module with ``embed_tokens`` and ``layers``: a causal LM's base model, the
    language model of a vision-language one, the critic's value model's ``base``)."""
    found = [m for m in model.modules() if hasattr(m, "embed_tokens") and hasattr(m, "layers")]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no text decoder (a module with embed_tokens and layers)")
    return found[0]


def _lm_head(model: nn.Module) -> Any:
    """The LM head of the causal LM in ``model`` (None for a decoder with another head, the critic's)."""
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        head = get() if get is not None else None
        if isinstance(head, nn.Module):
            return head
    return None


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard ``model`` (a causal LM, peft's wrapper of one, ``ForwardModule`` over one, or the critic's value model)
    in place over the 1-D device mesh ``tp_mesh`` with the plan of the module docstring. A family outside
    :data:`SUPPORTED` is a ValueError naming them."""
    # here, not at the top: DTensor's parallel styles load only in a sharded run (~0.5 s)
    from torch.distributed.tensor import Replicate  # noqa: PLC0415  (FSDP: only in a sharded run)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415  (FSDP: only in a sharded run)

    decoder = _text_decoder(model)
    model_type = str(getattr(decoder.config, "model_type", "")).removesuffix("_text")
    if model_type not in SUPPORTED:
        raise ValueError(f"tensor parallelism has plans for {list(SUPPORTED)}, not model_type {model_type!r}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder.layers:
        parallelize_module(layer, tp_mesh, {name: styles[kind]() for name, kind in _layer_plan(layer).items()})
    for module in (decoder.embed_tokens, _lm_head(model)):
        if module is not None and hasattr(module, "lora_A"):
            raise ValueError("tensor parallelism splits the embedding and the LM head by vocabulary, which LoRA "
                             "adapters on them cannot follow: leave embed_tokens and lm_head out of "
                             "actor.lora_target_modules")
    head = _lm_head(model)
    tied = head is not None and head.weight is decoder.embed_tokens.weight
    parallelize_module(decoder.embed_tokens, tp_mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if tied:
        head.weight = decoder.embed_tokens.weight
    elif head is not None:
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[vocab_start, vocab_start + len(weight))`` of a vocabulary-parallel LM head (plain
    tensors, differentiable back to the sharded parameters) and the tensor-parallel process group."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    vocab_start: int
    group: Any


def vocab_shard(head: Any) -> Optional[VocabShard]:
    """The head's :class:`VocabShard` when its weight is a DTensor sharded on the vocabulary over a mesh dimension
    named "tp" (:func:`apply_tensor_parallel`; inside FSDP2's forward the data-parallel dimension is gathered
    already); None for a plain head."""
    weight: Any = head.weight
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    dim = mesh.mesh_dim_names.index("tp")
    placement = weight.placements[dim]
    if not (placement.is_shard() and placement.dim == 0):
        return None
    if len(mesh.mesh_dim_names) > 1:
        raise ValueError(f"the LM head is still sharded over {mesh.mesh_dim_names}: run log-probs inside the "
                         "data-parallel wrapper's forward (portrl.workers.parallel.ForwardModule)")
    local = weight.to_local()
    bias = getattr(head, "bias", None)
    bias = bias.to_local() if bias is not None and hasattr(bias, "to_local") else bias
    return VocabShard(local, bias, mesh.get_local_rank(dim) * local.shape[0], mesh.get_group(dim))
