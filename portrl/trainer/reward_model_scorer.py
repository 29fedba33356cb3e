"""Reward-model scoring: a local Hugging Face sequence-classification model (one output) scores (prompt,
response) texts. Nothing is downloaded: ``path`` must be a local directory with the model and its tokenizer.

Text scored: the tokenizer's chat template over ``[user: prompt, assistant: response]`` when it has one
(how reward models are trained), else ``prompt + response``. Rows are right-padded per batch; the model reads
the score at the last non-padding token (transformers' convention, keyed on ``config.pad_token_id``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

if TYPE_CHECKING:
    from portrl.device.backend import Backend


class RewardModelScorer:
    """``RewardModelScorer(path, backend).score(prompts, responses) -> (B,) float32 tensor on the CPU``."""

    def __init__(self, path: str, backend: Backend, *, dtype: Optional[str] = None, batch_size: int = 8,
                 max_length: Optional[int] = None):
        p = Path(path)
        if not p.is_dir() or not (p / "config.json").is_file():
            raise FileNotFoundError(f"reward.model_path {path!r} is not a local model directory (no config.json); "
                                    "give a directory written by save_pretrained (nothing is downloaded)")
        if batch_size < 1:
            raise ValueError(f"RewardModelScorer: batch_size must be >= 1, got {batch_size}")
        self.backend, self.batch_size, self.max_length = backend, batch_size, max_length
        self.device = backend.device()
        torch_dtype = getattr(torch, dtype or backend.supported_dtypes()[0])
        self.tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
        self.tokenizer.padding_side = "right"
        # use_kernels=False: no Hub kernels swapped in (portrl/models/loader.py says why)
        self.model = AutoModelForSequenceClassification.from_pretrained(p, local_files_only=True, dtype=torch_dtype,
                                                                        use_kernels=False)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path!r} has num_labels={self.model.config.num_labels}; a reward model "
                             "has one output (num_labels=1)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"reward model tokenizer at {path!r} has neither a pad nor an eos token")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()

    def format(self, prompt: str, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return str(self.tokenizer.apply_chat_template(msgs, tokenize=False))  # tokenize=False: the text
        return prompt + response

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModelScorer.score: {len(prompts)} prompts but {len(responses)} responses")
        texts: List[str] = [self.format(p, r) for p, r in zip(prompts, responses)]
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[s:s + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length,
                                 add_special_tokens=False)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            out.append(self.model(**enc).logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)
