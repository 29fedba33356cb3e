"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL): the rotation and the 3-D position index.

A vision-language decoder gives every token three position ids, one per axis ``a`` in (temporal, height,
width). Text tokens have the same id on all three axes (an ordinary 1-D position); the ``t' * h' * w'``
tokens of an image (its grid ``(t, h, w)`` of patches merged ``m x m``: ``h' = h // m``, ``w' = w // m``)
get ``start + (i_t, i_h, i_w)``, their place in the merged grid, where ``start`` is the position after the
text before them; the text after an image resumes at ``start + max(h', w')`` (for still images ``t = 1``).

The rotary dims are split between the axes: with ``mrope_section = (s_t, s_h, s_w)`` (sum ``D / 2``) the
frequency index ``j`` of the half-dim belongs to axis ``a(j)`` = 0 for ``j < s_t``, 1 for
``s_t <= j < s_t + s_h``, 2 after; both halves of the "half" rotary layout use the same split. Given the
per-axis tables ``cos[a], sin[a] = cos / sin(pos_a * inv_freq)`` laid out as ``(.., D)`` with the two halves
repeated (the usual rotary embedding of each axis' positions), the multimodal table takes column ``c`` from
axis ``a(c mod D/2)``::

    cos_m[..., c] = cos[a(c mod D/2)][..., c]        (likewise sin_m)
    out = x * cos_m + rotate_half(x) * sin_m

which is the rotation of transformers' ``Qwen2VLRotaryEmbedding`` / ``Qwen2_5_VLRotaryEmbedding`` followed
by ``apply_rotary_pos_emb`` (older transformers and verl: ``apply_multimodal_rotary_pos_emb``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from portrl.ops.layers import apply_rotary


def _check_section(mrope_section: Sequence[int], dim: int) -> tuple[int, int, int]:
    section = tuple(int(s) for s in mrope_section)
    if len(section) != 3 or min(section) < 0 or 2 * sum(section) != dim:
        raise ValueError(f"mrope_section must be 3 non-negative sizes (temporal, height, width) summing to half the "
                         f"rotary dim {dim // 2}; got {list(mrope_section)}")
    return section


def multimodal_cos_sin(cos: torch.Tensor, sin: torch.Tensor,
                       mrope_section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_m, sin_m)`` of shape ``cos.shape[1:]`` from the per-axis tables ``cos, sin`` of shape ``(3, ..., D)``."""
    if cos.shape != sin.shape or cos.dim() < 2 or cos.shape[0] != 3:
        raise ValueError(f"cos and sin must share a shape (3, ..., D) (one table per axis); got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    section = _check_section(mrope_section, cos.shape[-1])
    split = list(section) * 2  # both halves of the "half" layout

    def pick(table: torch.Tensor) -> torch.Tensor:
        return torch.cat([part[i % 3] for i, part in enumerate(table.split(split, dim=-1))], dim=-1)

    return pick(cos), pick(sin)


def apply_multimodal_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            mrope_section: Sequence[int]) -> torch.Tensor:
    """M-RoPE (the module docstring's formula). ``x`` is ``(..., D)``; ``cos, sin`` are ``(3, ..., D)`` and, after
    the axis selection, broadcast to ``x`` (e.g. ``x (total, H, D)`` with tables ``(3, total, 1, D)``)."""
    cos_m, sin_m = multimodal_cos_sin(cos, sin, mrope_section)
    return apply_rotary(x, cos_m.to(x.dtype), sin_m.to(x.dtype))


def multimodal_rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_token_id: int,
                          spatial_merge_size: int, attention_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3-D positions of the module docstring: ``(positions (3, B, L) long, deltas (B, 1) long)``.

    ``input_ids`` ``(B, L)``: every image is a run of ``t * h' * w'`` tokens ``image_token_id`` (the processor's
    expanded prompt); images are taken from ``image_grid_thw`` ``(n_images, 3)`` in row-major order over the
    batch. Padding (``attention_mask`` 0) is skipped and gets position 0. ``deltas[b] = max position + 1 -
    (number of real tokens)``: a decoded token at real index ``n`` has position ``n + delta`` on all axes.
    Rows without images get ordinary positions 0..n-1 and delta 0.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length); got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.reshape(-1, 3)]
    m = int(spatial_merge_size)
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    deltas = []
    next_image = 0
    for b in range(input_ids.shape[0]):
        keep = (torch.ones_like(input_ids[b], dtype=torch.bool) if attention_mask is None
                else attention_mask[b].bool())
        ids = input_ids[b][keep].tolist()
        rows: list[torch.Tensor] = []
        pos, i = 0, 0
        while i < len(ids):
            if ids[i] != image_token_id:
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos, i = pos + j - i, j
                continue
            if next_image >= len(grids):
                raise ValueError(f"row {b} has more image token runs than image_grid_thw has images ({len(grids)})")
            t, h, w = grids[next_image]
            next_image += 1
            gh, gw = h // m, w // m
            n = t * gh * gw
            if ids[i:i + n] != [image_token_id] * n:
                raise ValueError(f"row {b}: image {next_image - 1} of grid {(t, h, w)} needs {n} image tokens "
                                 f"(merge {m}) at index {i}; the row has fewer")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            rows.append(grid.reshape(3, -1) + pos)
            pos, i = pos + max(gh, gw), i + n
        row = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
        positions[:, b, keep] = row.to(positions.device)
        deltas.append((int(row.max()) + 1 - len(ids)) if len(ids) else 0)
    if next_image != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} images but the rows hold {next_image} image token runs")
    return positions, torch.tensor(deltas, dtype=torch.long, device=input_ids.device).unsqueeze(1)
