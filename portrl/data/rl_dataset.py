"""RLDataset: verl-schema parquet prompts, tokenised with the chat template, served as PromptBatch.

Each row's ``prompt`` messages go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
and are tokenised without extra special tokens. A prompt longer than ``max_prompt_length`` is dropped
when ``filter_overlong_prompts`` (default), else handled by ``truncation``: "error" (DataError naming
the file and row), "left" (keep the last tokens) or "right" (keep the first tokens).

Rows with images (an ``images`` column beside ``prompt``, one ``<image>`` placeholder per image; see
portrl/data/images.py) need ``processor=`` (the vision-language model's processor): their prompt ids are the
processor's, each image's pad token expanded (portrl/data/multimodal.py), and ``max_prompt_length`` counts
those expanded ids; such a prompt is never truncated (too long: dropped when ``filter_overlong_prompts``, else a
DataError). ``PromptBatch.multi_modal[i]`` is None for a text row, else ``{"images": [RGB PIL images],
"raw_prompt_ids": [ids with one pad token per image], "inputs": {"pixel_values", "image_grid_thw", ...}}``, the
processor run again on the row's images when the batch is built (only ids are kept between batches). Text rows
are tokenised as above with or without a processor.

``batches(batch_size)`` iterates forever: each epoch is a permutation of the rows seeded by
``(seed, epoch)`` (or file order when ``shuffle=False``); the last incomplete batch of an epoch is
dropped. ``state_dict()`` after a batch and ``load_state_dict`` before ``batches`` resume exactly at
the next batch.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow.parquet as pq
import torch

from portrl.data.images import IMAGE_KEY, check_row_images, decode_image
from portrl.data.multimodal import encode_image_prompt
from portrl.data.schema import DataError, MissingDataFile, check_row
from portrl.data.table_rows import table_rows

log = logging.getLogger(__name__)
TRUNCATIONS = ("error", "left", "right")


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # (B, P) long, left-padded with the pad id
    attention_mask: torch.Tensor  # (B, P) long, 1 on prompt tokens
    prompt_ids: list[list[int]]  # unpadded
    data_source: list[str]
    ground_truth: list[str]
    extra_info: list[dict]
    uid: list[str]  # unique per prompt per epoch: "e{epoch}-r{row}"
    messages: list[list[dict]]  # the chat messages, for logging
    multi_modal: list[dict | None] | None = None  # per prompt: None (text) or images, raw_prompt_ids, inputs
    agent_name: list[str | None] | None = None  # per prompt: verl's agent_name column (multi-turn rollouts), or None

    def __len__(self) -> int:
        return len(self.prompt_ids)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape (B, length or longest) with each sequence right-aligned."""
    width = max((len(s) for s in sequences), default=0) if length is None else length
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) > width:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, more than the padded width {width}")
        if seq:
            ids[i, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


def as_file_list(files: str | Path | Sequence[str | Path]) -> list[Path]:
    """One or more parquet paths, each checked to exist."""
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not paths:
        raise DataError("no dataset files given")
    for p in paths:
        if not p.is_file():
            raise MissingDataFile(f"dataset file {str(p)!r} does not exist")
    return paths


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id; error when it has neither."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set tokenizer.pad_token")


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of chat messages through the chat template, ending with the generation prompt; ``tools`` (the
    OpenAI function schemas of a multi-turn run's tools) go to the template, which lists them where it does."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class RLDataset:
    """Prompts of one or more verl-schema parquet files (see the module docstring)."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, max_prompt_length: int = 1024,
                 filter_overlong_prompts: bool = True, truncation: str = "error", shuffle: bool = True,
                 seed: int = 0, prompt_key: str = "prompt", pad_to_max_length: bool = False, processor=None,
                 image_key: str = IMAGE_KEY, tools: list[dict] | None = None):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; RLDataset builds prompts with it")
        self.files = as_file_list(files)
        self.max_prompt_length = int(max_prompt_length)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.pad_id = pad_token_id(tokenizer)
        self.pad_to_max_length = pad_to_max_length
        self.processor = processor
        self._rows: list[tuple[list[int], str, str, dict, list[dict]]] = []
        self._images: dict[int, tuple[list, str, list[int]]] = {}  # row -> (stored images, text, raw_prompt_ids)
        self._agent_names: dict[int, str] = {}  # row -> its agent_name column (multi-turn rollouts), when set
        dropped = 0
        for path in self.files:
            try:
                records = table_rows(pq.read_table(path), str(path))
            except DataError:
                raise
            except Exception as exc:
                raise DataError(f"{path}: cannot be read as parquet ({type(exc).__name__}: {exc})") from None
            for i, rec in enumerate(records):
                messages, source, truth, extra = check_row(rec, str(path), i, prompt_key)
                images = check_row_images(rec, str(path), i, messages, image_key)
                if images is not None:
                    prompt = self._image_prompt(images, messages, str(path), i)
                    ids = prompt.ids
                    if len(ids) > self.max_prompt_length:
                        if filter_overlong_prompts:
                            dropped += 1
                            continue
                        raise DataError(f"{path}: row {i}: prompt has {len(ids)} tokens with its images > "
                                        f"max_prompt_length {self.max_prompt_length}, and a prompt with images is "
                                        "not truncated (set filter_overlong_prompts or raise max_prompt_length)")
                    self._images[len(self._rows)] = (images, prompt.text, prompt.raw_prompt_ids)
                    self._rows.append((ids, source, truth, extra, messages))
                    continue
                ids = encode_messages(tokenizer, messages, tools)
                if len(ids) > self.max_prompt_length:
                    if filter_overlong_prompts:
                        dropped += 1
                        continue
                    if truncation == "error":
                        raise DataError(f"{path}: row {i}: prompt has {len(ids)} tokens > max_prompt_length "
                                        f"{self.max_prompt_length} (set filter_overlong_prompts or truncation)")
                    ids = ids[-self.max_prompt_length:] if truncation == "left" else ids[:self.max_prompt_length]
                if rec.get("agent_name") is not None:
                    self._agent_names[len(self._rows)] = str(rec["agent_name"])
                self._rows.append((ids, source, truth, extra, messages))
        if dropped:
            log.info("RLDataset: dropped %d prompts longer than %d tokens", dropped, self.max_prompt_length)
        if not self._rows:
            raise DataError(f"the dataset is empty after filtering ({dropped} prompts over max_prompt_length "
                            f"{self.max_prompt_length}) in {', '.join(map(str, self.files))}")
        self.epoch, self.position = 0, 0

    def _image_prompt(self, images: list, messages: list[dict], where: str, index: int):
        if self.processor is None:
            raise DataError(f"{where}: row {index}: the row has {len(images)} image(s), but the model has no image "
                            "processor; train on images with a vision-language model (a model directory with "
                            "preprocessor_config.json, e.g. Qwen2.5-VL), or use text-only data")
        return encode_image_prompt(self.processor, messages, [decode_image(im) for im in images])

    def _multi_modal(self, row: int) -> dict | None:
        """The row's images and processor inputs (None for a text row), the ids checked against the stored ones."""
        entry = self._images.get(row)
        if entry is None:
            return None
        images, text, raw_prompt_ids = entry
        pil = [decode_image(im) for im in images]
        prompt = encode_image_prompt(self.processor, self._rows[row][4], pil, text=text)
        if prompt.ids != self._rows[row][0]:
            raise RuntimeError(f"the processor expanded row {row}'s images to other ids than when the dataset was "
                               "built; the image processor must be deterministic")
        return {"images": pil, "raw_prompt_ids": list(raw_prompt_ids), "inputs": prompt.inputs}

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def order(self, epoch: int) -> list[int]:
        """The row order of one epoch."""
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def batches(self, batch_size: int) -> Iterator[PromptBatch]:
        """PromptBatch after PromptBatch, forever, from the current (epoch, position)."""
        if not 0 < batch_size <= len(self._rows):
            raise ValueError(f"batch_size must be in 1..{len(self._rows)} (the dataset size), got {batch_size}")
        while True:
            order = self.order(self.epoch)
            while self.position + batch_size <= len(order):
                picked = order[self.position:self.position + batch_size]
                self.position += batch_size
                yield self._collate(picked, self.epoch)
            self.epoch, self.position = self.epoch + 1, 0

    def _collate(self, picked: list[int], epoch: int) -> PromptBatch:
        rows = [self._rows[i] for i in picked]
        ids, mask = left_pad([r[0] for r in rows], self.pad_id,
                             self.max_prompt_length if self.pad_to_max_length else None)
        return PromptBatch(
            input_ids=ids, attention_mask=mask, prompt_ids=[list(r[0]) for r in rows],
            data_source=[r[1] for r in rows], ground_truth=[r[2] for r in rows],
            extra_info=[dict(r[3]) for r in rows], uid=[f"e{epoch}-r{i}" for i in picked],
            messages=[r[4] for r in rows],
            multi_modal=[self._multi_modal(i) for i in picked] if self._images else [None] * len(rows),
            agent_name=[self._agent_names.get(i) for i in picked] if self._agent_names else None,
        )

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self._rows)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position; the dataset (row count, seed, shuffle) must be the same."""
        for key in ("num_rows", "seed", "shuffle"):
            mine = len(self._rows) if key == "num_rows" else getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(f"dataset state was saved with {key}={state[key]!r} but this dataset has {mine!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._rows):
            raise ValueError(f"invalid dataset state epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position
