"""A vision-language prompt through the model's processor: the ids the model sees and the image inputs.

As verl's RL dataset (RLHFDataset) does: each message's content is split at ``<image>``
into ``{"type": "image"}`` and ``{"type": "text", "text": ...}`` parts, the processor's chat template renders
them (Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>`` per image), and ``processor(text, images)``
expands each image's pad token to as many as the image has merged patches and returns the pixel inputs.

:func:`encode_image_prompt` gives an :class:`ImagePrompt`: the expanded ids (the prompt the policy is trained
on), the rendered text, the ids of that text with ONE pad per image (verl's ``raw_prompt_ids``, what engines
that expand images themselves take) and the processor's image inputs (``pixel_values``, ``image_grid_thw``,
...), without the token-aligned outputs (``input_ids``, ``attention_mask``, ``mm_token_type_ids``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from portrl.data.images import IMAGE_PLACEHOLDER

_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")
#: processor outputs aligned with the tokens (the prompt ids carry them) or for videos only, not image inputs
TOKEN_ALIGNED = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "second_per_grid_ts")


@dataclass
class ImagePrompt:
    ids: list[int]  # the chat-template ids with each image's pad token expanded, as the model takes them
    text: str  # the rendered chat-template text (one pad token per image)
    raw_prompt_ids: list[int]  # the ids of ``text``: one pad token per image
    inputs: dict[str, torch.Tensor]  # pixel_values, image_grid_thw (n_images, 3), ...


def content_parts(messages: list[dict]) -> list[dict]:
    """The messages with each content split at ``<image>`` into image and text parts (empty text left out)."""
    out = []
    for m in messages:
        parts = []
        for segment in _PLACEHOLDER_RE.split(m["content"]):
            if segment == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
            elif segment:
                parts.append({"type": "text", "text": segment})
        out.append({"role": m["role"], "content": parts})
    return out


def render_image_prompt(processor, messages: list[dict]) -> str:
    """The processor's chat template over the messages' image and text parts, with the generation prompt."""
    return processor.apply_chat_template(content_parts(messages), add_generation_prompt=True, tokenize=False)


def encode_image_prompt(processor, messages: list[dict], images: list[Any], text: str | None = None) -> ImagePrompt:
    """The prompt of ``messages`` (with ``<image>`` placeholders) and its PIL ``images`` through ``processor``.
    ``text``: the rendered template when already known (:func:`render_image_prompt`)."""
    text = render_image_prompt(processor, messages) if text is None else text
    out = processor(text=[text], images=images, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    inputs = {k: v for k, v in out.items() if k not in TOKEN_ALIGNED}
    raw = list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ImagePrompt(ids=ids, text=text, raw_prompt_ids=raw, inputs=inputs)
