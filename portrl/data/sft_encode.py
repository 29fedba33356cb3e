"""Token ids and loss mask of one SFT row: ``prompt`` (chat messages) and ``response``, a string or a conversation.

* ``response`` a string: the prompt ids as RLDataset encodes them (chat template with the generation prompt), the
  response ids ``tokenizer(response, add_special_tokens=False) + [eos]``, every response token trained.
* ``response`` a list of chat messages, the conversation after the prompt (for example assistant tool call, tool
  result, assistant answer; it starts and ends with an assistant message): the whole conversation goes through the
  tokenizer's chat template at once (``apply_chat_template``, nothing of the format is written here). The response
  is what follows the prompt's ids, up to the end of the last assistant message; the loss mask is 1 on the tokens
  of every assistant message (its content and the end-of-turn token, the tokenizer's eos, where a rollout's turn
  stops) and 0 on everything else (tool, user and system messages, the role headers the template writes, what it
  writes after an eos). An assistant message's tokens are found by rendering the conversation up to it with the
  generation prompt, and through it: a template that does not render those prefixes as token prefixes of the whole
  conversation is a DataError, as is a malformed message.

The same layout as a multi-turn rollout (portrl/agent/trajectory.py): response_mask 1 on model tokens, 0 on the
context between them, so SFT teaches exactly what the agent loop samples.
"""

from __future__ import annotations

from typing import Any

from portrl.data.rl_dataset import encode_messages
from portrl.data.schema import DataError

SFTIds = tuple[list[int], list[int], list[int]]  # prompt ids, response ids, loss mask (one per response id)


def check_messages(messages: Any, what: str) -> list[dict]:
    """``messages`` as a list of plain dicts, each with a str ``role`` and ``content`` (keys whose value is None
    are dropped: a parquet struct holds every key any message has); DataError naming ``what`` otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{what} must be a non-empty list of {{'role': str, 'content': str}} messages")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def encode_sft_example(tokenizer: Any, prompt: Any, response: Any, prompt_key: str = "prompt",
                       response_key: str = "response") -> SFTIds:
    """(prompt ids, response ids, loss mask) of one row (module docstring); DataError for a bad row, naming the
    field (``prompt_key`` / ``response_key``)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; SFT responses end with it")
    messages = check_messages(prompt, f"field {prompt_key!r}")
    if isinstance(response, str):
        ids = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [int(eos)]
        return encode_messages(tokenizer, messages), ids, [1] * len(ids)
    if not isinstance(response, (list, tuple)):
        raise DataError(f"field {response_key!r} must be a string, or the conversation after the prompt as a list "
                        f"of chat messages; got {type(response).__name__}")
    turns = check_messages(response, f"field {response_key!r} (a conversation)")
    if turns[0]["role"] != "assistant" or turns[-1]["role"] != "assistant":
        raise DataError(f"field {response_key!r}: a conversation must start and end with an assistant message; its "
                        f"roles are {', '.join(t['role'] for t in turns)}")
    return _encode_conversation(tokenizer, messages, turns, int(eos))


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_conversation(tokenizer: Any, prompt: list[dict], turns: list[dict], eos: int) -> SFTIds:
    messages = prompt + turns
    full = _render(tokenizer, messages, False)
    prompt_ids = encode_messages(tokenizer, prompt)
    mask = [0] * len(full)
    end = len(prompt_ids)
    for i in range(len(prompt), len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True)
        through = _render(tokenizer, messages[:i + 1], False)
        for part, name in ((before, "with the generation prompt"), (through, "through it")):
            if full[:len(part)] != part:
                raise DataError(f"the chat template renders the conversation up to message {i} ({name}) "
                                "differently from the start of the whole conversation, so the assistant tokens "
                                "cannot be found; SFT on conversations needs a template that only appends")
        stop = len(through)
        if eos in through[len(before):]:
            stop = through.index(eos, len(before)) + 1  # the template's end of turn: what follows is context
        mask[len(before):stop] = [1] * (stop - len(before))
        end = stop
    return prompt_ids, full[len(prompt_ids):end], mask[len(prompt_ids):end]
