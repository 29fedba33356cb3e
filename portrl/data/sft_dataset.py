"""SFTDataset: prompt/response parquet rows as token ids for supervised fine-tuning.

A row holds ``prompt`` (chat messages, as in verl's schema) and ``response``: a string, or the conversation after
the prompt as chat messages (assistant, tool, ..., assistant). The prompt is encoded exactly as RLDataset encodes
it (chat template with the generation prompt); a string response as ``tokenizer(response,
add_special_tokens=False) + [eos]``, a conversation through the chat template with the loss on its assistant
messages only (portrl/data/sft_encode.py), so SFT teaches the format RL samples.
A pair longer than ``max_length`` is an error (``truncation="error"``) or loses the end of its
response (``"right"``); a prompt alone longer than max_length is always an error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pyarrow.parquet as pq
import torch

from portrl.data.rl_dataset import as_file_list, pad_token_id
from portrl.data.schema import DataError
from portrl.data.sft_encode import encode_sft_example
from portrl.data.table_rows import table_rows


@dataclass
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with eos unless truncated
    loss_mask: list[int] | None = None  # per response id: 1 trained, 0 context (a tool message); None: all 1


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, L) long, prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L), 1 on the response tokens to predict (not on a conversation's tool messages)
    examples: list[SFTExample]


class SFTDataset:
    """Prompt/response examples of one or more parquet files (see the module docstring)."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, max_length: int,
                 prompt_key: str = "prompt", response_key: str = "response", truncation: str = "error"):
        if truncation not in ("error", "right"):
            raise ValueError(f"SFT truncation must be 'error' or 'right', got {truncation!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; SFT responses end with it")
        self.pad_id = pad_token_id(tokenizer)
        self.examples: list[SFTExample] = []
        for path in as_file_list(files):
            for i, rec in enumerate(table_rows(pq.read_table(path), str(path))):
                try:
                    prompt_ids, response_ids, mask = encode_sft_example(
                        tokenizer, rec.get(prompt_key), rec.get(response_key), prompt_key, response_key)
                except DataError as exc:
                    raise DataError(f"{path}: row {i}: {exc}") from None
                if len(prompt_ids) >= max_length:
                    raise DataError(f"{path}: row {i}: prompt has {len(prompt_ids)} tokens, max_length is {max_length}")
                if len(prompt_ids) + len(response_ids) > max_length:
                    if truncation == "error":
                        raise DataError(f"{path}: row {i}: prompt + response has "
                                        f"{len(prompt_ids) + len(response_ids)} tokens > max_length {max_length}")
                    keep = max_length - len(prompt_ids)
                    response_ids, mask = response_ids[:keep], mask[:keep]
                self.examples.append(SFTExample(prompt_ids, response_ids, mask))
        if not self.examples:
            raise DataError(f"no SFT examples in {', '.join(map(str, as_file_list(files)))}")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]

    def collate(self, examples: Sequence[SFTExample]) -> SFTBatch:
        """Right-padded prompt+response ids with the loss mask on response tokens."""
        width = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(examples), width), dtype=torch.long)
        loss = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            p, n = len(e.prompt_ids), len(e.prompt_ids) + len(e.response_ids)
            ids[i, :n] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
            attn[i, :n] = 1
            loss[i, p:n] = 1 if e.loss_mask is None else torch.tensor(e.loss_mask, dtype=torch.long)
        return SFTBatch(ids, attn, loss, list(examples))

    def batches(self, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0) -> Iterator[SFTBatch]:
        """The batches of one epoch (the last one may be smaller), order seeded by (seed, epoch)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        order = list(range(len(self.examples)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        for start in range(0, len(order), batch_size):
            yield self.collate([self.examples[i] for i in order[start:start + batch_size]])
