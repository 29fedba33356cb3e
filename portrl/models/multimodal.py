"""Vision-language models (Qwen2-VL / Qwen2.5-VL) in portrl's forward: image inputs and 3-D rotary positions.

A row's prompt holds its images as runs of image tokens (the processor expands each ``<|image_pad|>`` to
``t * (h/m) * (w/m)`` tokens for an image of grid ``(t, h, w)`` patches merged ``m x m``); its ``multi_modal``
entry (the data contract of portrl/data/rl_dataset.py) carries the processor's ``pixel_values`` and
``image_grid_thw``. For a batch the image inputs of its rows are concatenated in row order
(:func:`batch_image_inputs`), which is the order in which the image-token runs occur in the row-major batch.

The forward (:func:`vl_response_hidden_states`) runs in three parts, so that nothing meant for the text decoder
(packed-sequence bounds) reaches the vision tower:

1. the vision tower encodes all images of the batch (``get_image_features``); their embeddings replace the
   prompt's image-token embeddings, in order;
2. 3-D positions (:func:`portrl.ops.multimodal_rope_index` on the prompt columns: image tokens get their place
   in the merged grid, text ordinary positions), and every response token ``j`` of a row the 1-D position
   ``n + j + delta`` on all three axes (``n`` real prompt tokens; ``delta`` the row's rope delta), which is what
   generation gave it: a token the model samples that happens to be an image token is text there too;
3. the text decoder on the embeddings, packed (one row of the batch's real tokens, ``position_ids`` of shape
   ``(4, 1, N)``: the 1-D positions restarting per sequence, which mark the sequence bounds, then the three
   rotary rows; ``cu_seq_lens`` for portrl's attention) or padded (``position_ids (3, B, L)``).

Under data parallelism a batch of text rows still runs the vision tower (on a blank image, contributing
nothing), so every rank's forward and backward use the same parameters. Shared prompts and the rollout's forward tape are not used for these models (different images can have the
same token ids, and the tape records the text-only fast decoder); :func:`portrl.models.compute_logprobs`
logs that once.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from portrl.ops.attention import cu_seqlens_from_lengths
from portrl.ops.rotary_multimodal import multimodal_rope_index


def is_vision_language(model_or_config: Any) -> bool:
    """True for a model (or config) with a vision tower and image tokens (Qwen2-VL, Qwen2.5-VL, ...)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "vision_config", None) is not None and getattr(cfg, "image_token_id", None) is not None


def vision_tower(model) -> torch.nn.Module | None:
    """The vision tower (image encoder and patch merger) of a vision-language model (``model.model.visual`` in
    transformers' Qwen-VL classes), else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for owner in (getattr(inner, getattr(inner, "base_model_prefix", ""), None), inner):
        tower = getattr(owner, "visual", None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def freeze_vision_tower(model) -> int:
    """Turn off gradients of a vision-language model's vision tower (``actor.freeze_vision_tower``; by default the
    whole model trains, as verl's FSDP actor trains it); returns how many parameters were frozen (0 for a text
    model)."""
    tower = vision_tower(model) if is_vision_language(model) else None
    if tower is None:
        return 0
    params = list(tower.parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


def batch_image_inputs(entries: Optional[Sequence[Any]], device=None) -> Optional[dict]:
    """``{"pixel_values", "image_grid_thw"}`` of a batch's rows, concatenated in row order, from their
    ``multi_modal`` entries (None for a text row, else a dict whose ``"inputs"`` holds the processor's tensors);
    None when no row has images."""
    pixels, grids = [], []
    for entry in entries or ():
        inputs = entry.get("inputs") if isinstance(entry, Mapping) else None
        if not inputs or inputs.get("pixel_values") is None:
            continue
        pixels.append(torch.as_tensor(inputs["pixel_values"]))
        grids.append(torch.as_tensor(inputs["image_grid_thw"]).reshape(-1, 3))
    if not pixels:
        return None
    out = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids).long()}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def _vision_parts(base):
    """``(vision tower owner, text decoder)`` of a VL base model (``model.model`` of the ForConditionalGeneration)."""
    text = getattr(base, "language_model", None)
    if text is None or not hasattr(base, "get_image_features"):
        raise TypeError(f"{type(base).__name__} is not a vision-language base model (no language_model / "
                        "get_image_features)")
    return base, text


def image_token_positions(input_ids: torch.Tensor, prompt_length: int, image_token_id: int) -> torch.Tensor:
    """Bool ``(B, L)``: the image tokens of the prompt columns (response columns never count)."""
    mask = input_ids == int(image_token_id)
    mask[:, prompt_length:] = False
    return mask


def embed_with_images(base, input_ids: torch.Tensor, prompt_length: int,
                      image_inputs: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """Token embeddings ``(B, L, H)`` with the prompt's image tokens replaced by the vision tower's outputs."""
    config = base.config
    embeds = base.get_input_embeddings()(input_ids)
    if image_inputs is None:
        if not _data_parallel():
            return embeds
        # text rows only, under data parallelism: run the vision tower on a blank image and add nothing, so that
        # every rank's forward uses the same parameters (DDP reduces every gradient, FSDP2 gathers per block)
        return embeds + 0.0 * _image_features(base, blank_image_inputs(config, embeds.device)).sum()
    feats = _image_features(base, image_inputs)
    where = image_token_positions(input_ids, prompt_length, config.image_token_id)
    if int(where.sum()) != feats.shape[0]:
        raise ValueError(f"the prompts hold {int(where.sum())} image tokens but their images give {feats.shape[0]} "
                         "embeddings (image_grid_thw does not match the expanded prompt ids)")
    return embeds.masked_scatter(where[..., None], feats.to(embeds.dtype))


def _image_features(base, image_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The merged image embeddings ``(n_image_tokens, H)`` of all images, in order."""
    out = base.get_image_features(image_inputs["pixel_values"], image_inputs["image_grid_thw"])
    feats = getattr(out, "pooler_output", out)  # transformers 5 returns an output object, 4.x the tensor(s)
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats


def _data_parallel() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def blank_image_inputs(config, device=None) -> dict:
    """The smallest image the vision tower takes: one merged token (a ``1 x m x m`` grid of zero patches)."""
    v = config.vision_config
    m, patch = int(v.spatial_merge_size), int(v.patch_size)
    width = int(v.in_channels) * int(v.temporal_patch_size) * patch * patch
    return {"pixel_values": torch.zeros(m * m, width, device=device),
            "image_grid_thw": torch.tensor([[1, m, m]], device=device)}


def vl_positions(config, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                 image_grid_thw: Optional[torch.Tensor]) -> torch.Tensor:
    """3-D positions ``(3, B, L)`` of prompt + response rows (module docstring, part 2); padding gets 0."""
    P = int(prompt_length)
    mask = attention_mask.bool()
    merge = int(config.vision_config.spatial_merge_size)
    pos_p, delta = multimodal_rope_index(input_ids[:, :P], image_grid_thw, int(config.image_token_id), merge,
                                         attention_mask[:, :P])
    n_prompt = mask[:, :P].sum(1, keepdim=True)
    resp = n_prompt + torch.arange(input_ids.shape[1] - P, device=input_ids.device) + delta.to(input_ids.device)
    resp = resp.masked_fill(~mask[:, P:], 0)
    return torch.cat([pos_p.to(input_ids.device), resp[None].expand(3, -1, -1)], dim=2)


def vl_response_hidden_states(base, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int,
                              packed: bool = True, image_inputs: Optional[Mapping[str, torch.Tensor]] = None):
    """``(hidden (n, H), resp_valid (B, T))`` as :func:`portrl.models.logprobs.response_hidden_states`, for a VL
    base model with the batch's ``image_inputs`` (:func:`batch_image_inputs`; None: text rows only)."""
    base, text = _vision_parts(base)
    batch, length = input_ids.shape
    T = int(response_length)
    P = length - T
    mask = attention_mask.bool()
    resp_valid = mask[:, P:]
    embeds = embed_with_images(base, input_ids, P, image_inputs)
    grid = None if image_inputs is None else image_inputs["image_grid_thw"]
    pos3 = vl_positions(base.config, input_ids, attention_mask, P, grid)
    if packed:
        lengths = mask.sum(1)
        flat_index = mask.reshape(-1).cumsum(0).reshape(mask.shape) - 1
        text_pos = (mask.cumsum(1) - 1)[mask]
        position_ids = torch.cat([text_pos[None], pos3[:, mask]])[:, None]  # (4, 1, N)
        cu = cu_seqlens_from_lengths(lengths)
        max_len = int(lengths.max())
        out = text(inputs_embeds=embeds[mask][None], position_ids=position_ids, use_cache=False,
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        hidden = out.last_hidden_state[0]
    else:
        out = text(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=pos3, use_cache=False)
        hidden = out.last_hidden_state.reshape(batch * length, -1)
        flat_index = torch.arange(batch * length, device=input_ids.device).reshape(batch, length)
    return hidden[flat_index[:, P - 1:length - 1][resp_valid]], resp_valid
