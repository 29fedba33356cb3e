"""LoRA adapters through peft (``actor.lora_rank > 0``) and the merged weights the rollout engine needs.

Merged weight of a LoRA linear layer (Hu et al. 2021): ``W' = W + (alpha / r) * B @ A`` (transposed when the
layer stores ``fan_in_fan_out``), summed over the active adapters; peft's ``scaling[adapter]`` holds
``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA). :func:`merged_weights` computes ``W'`` on the fly, so the
training model keeps its separate adapters; the names are the base model's (``model.layers.0.self_attn.
q_proj.weight``), which is what a rollout engine built from the base checkpoint expects.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterator, Tuple

import torch
from torch import nn
from transformers import AutoConfig

from portrl.device import import_optional
from portrl.models.hf_types import HFModule
from portrl.models.loader import model_class
from portrl.models.multimodal import vision_tower

if TYPE_CHECKING:
    from portrl.config.schema import ActorConfig, PortRLConfig

PEFT_INSTALL = "pip install 'peft>=0.13'"
ALL_LINEAR = "all-linear"  # lora_target_modules: [all-linear] adapts every linear layer but the output head


def apply_lora(model: nn.Module, cfg: PortRLConfig | ActorConfig) -> nn.Module:
    """``model`` with LoRA adapters of ``actor.lora_rank`` / ``lora_alpha`` on ``actor.lora_target_modules``
    (a peft ``PeftModel``; only the adapters train). ``cfg`` is the run config (or its ``actor`` group).
    ``[all-linear]`` (verl's default) adapts every linear layer but the output head; a vision-language model's
    vision tower is excluded (its language model is adapted)."""
    either: Any = cfg  # told apart by whether it has an actor group
    actor: ActorConfig = either.actor if hasattr(either, "actor") else either
    targets: str | list[str]  # a list of module names, or peft's shorthand (below)
    rank, alpha, targets = int(actor.lora_rank), int(actor.lora_alpha), list(actor.lora_target_modules)
    if rank <= 0:
        raise ValueError(f"apply_lora: actor.lora_rank must be > 0, got {rank}")
    if not targets:
        raise ValueError("apply_lora: actor.lora_target_modules is empty; name the linear layers to adapt, "
                         "e.g. [q_proj, k_proj, v_proj, o_proj]")
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR  # peft's shorthand
    else:
        _check_targets(model, targets)
    peft = import_optional("peft", PEFT_INSTALL)
    # a vision-language model adapts its language model only: the vision tower (whose MLP shares the decoder's
    # layer names) gets no adapters and, like every base weight under LoRA, stays frozen
    tower = vision_tower(model)
    prefix = next((n for n, m in model.named_modules() if m is tower), None) if tower is not None else None
    exclude = {"exclude_modules": rf"{re.escape(prefix)}(\..*)?"} if prefix else {}
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                             task_type="CAUSAL_LM", **exclude)
    # The adapters' random init (A; B starts at zero) comes from trainer.seed alone: every data-parallel rank must
    # build the same adapters (FSDP2 shards what each rank built; nothing broadcasts it), and the init must not
    # depend on what else drew random numbers before (a flag such as gradient checkpointing changed it).
    seed = int(cfg.trainer.seed) if hasattr(cfg, "trainer") else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def check_target_modules(model_dir: str, targets: list) -> None:
    """:func:`_check_targets` for the model in ``model_dir``, built from its config.json on the meta device (no
    weights read): a wrong ``actor.lora_target_modules`` is found before any model loads."""
    if list(targets) == [ALL_LINEAR]:
        return
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    _check_targets(model, list(targets))


def _check_targets(model: nn.Module, targets: list) -> None:
    """A ValueError naming the targets that are no module of ``model``, and the linear layers it has."""
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"actor.lora_target_modules {missing} are not modules of {type(model).__name__}; "
                         f"linear layers it has: {linear}, or [{ALL_LINEAR}]")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _delta(layer: HFModule) -> torch.Tensor | None:
    """Sum over active adapters of ``scaling * B @ A`` (None when adapters are disabled or already merged)."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return None
    delta = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name, False):
            raise NotImplementedError("merged_weights: DoRA adapters are not supported (use plain LoRA)")
        a = _full(layer.lora_A[name].weight).float()
        b = _full(layer.lora_B[name].weight).float()
        d = (b @ a) * float(layer.scaling[name])
        if getattr(layer, "fan_in_fan_out", False):
            d = d.T
        delta = d if delta is None else delta + d
    return delta


def _merged_entries(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor, Any]]:
    """``(base-model name, the state's tensor as held (a DTensor when sharded), the LoRA layer whose delta merges
    into it or None)`` of each tensor :func:`merged_weights` yields, in its order; nothing is gathered."""
    wrapped: HFModule = model
    base: HFModule = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped
    layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    for name, t in base.state_dict().items():
        if ".lora_" in name or "lora_magnitude" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = None
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            owner = owner[: -len(".base_layer")]
            layer = layers[owner] if leaf == "weight" else None
        yield f"{owner}.{leaf}" if owner else leaf, t, layer


def merged_weights(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the full model with every LoRA delta merged in, named as in the base model, in
    the base model's dtype. The training model is not changed. Sharded (DTensor) parameters are gathered one
    at a time as it is iterated, so under FSDP or a mesh every rank must iterate it. A model without adapters
    yields its own state."""
    for name, t, layer in _merged_entries(model):
        t = _full(t).detach()
        delta = None if layer is None else _delta(layer)
        if delta is not None:
            t = (t.float() + delta.to(t.device)).to(t.dtype)
        yield name, t


def merged_weight_meta(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, full shape, dtype name)`` of each tensor of :func:`merged_weights`, in its order, read without
    gathering anything (a DTensor's shape is its global one): what a weight sync announces before the tensors
    are gathered bucket by bucket (portrl.device.weight_transport.TransportSender.send's ``meta``)."""
    return [(name, tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))
            for name, t, _ in _merged_entries(model)]
