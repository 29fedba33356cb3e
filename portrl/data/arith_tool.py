"""The built-in tool-use task ``arith_tool``: arithmetic on numbers too large for the tiny model, solved with the
``calculator`` tool (portrl/agent/tools), generated offline and deterministic by seed.

RL rows are in verl's multi-turn schema: ``prompt`` is one short user message (``"Compute 4821*913."``),
``agent_name`` is ``"tool_agent"`` (the agent loop that runs the row), ``extra_info.tools_kwargs`` gives the
calculator the row's ``create_kwargs`` (the ground truth, as verl's gsm8k tool rows do; the calculator does not
need it, and parquet cannot store an empty struct), ``reward_model.ground_truth`` is the exact result, data_source
``arith_tool`` (its reward, portrl.rewards.arith_tool, reads the final ``<answer>N</answer>`` after the last tool
response).

SFT rows (the warm start, ``portrl sft``, ``portrl preprocess arith_tool --sft``) add ``response``: the ideal
conversation after the prompt, as chat messages (portrl/data/sft_encode.py trains the assistant messages only)::

    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "4821*913"}}\\n</tool_call>
    tool       4401573
    assistant  <answer>4401573</answer>

The tool call is written in the hermes format Qwen2.5 uses, as plain assistant content.

Difficulty (1-10): a product of two numbers of ``difficulty + 2`` to ``difficulty + 3`` digits each (level 1:
3-4 digits, ``"Compute 4821*913."``, already far beyond what the tiny model computes; level 2: 4-5 digits; level 10:
12-13 digits). The tool makes every level easy; what grows with the level is what the model must copy exactly (the
expression into the call, the tool's result into the answer). Splits are disjoint whatever the seeds, as in
arith: a problem is in the test split when a CRC32 of its expression falls below ``test_fraction`` of the range.
"""

from __future__ import annotations

import json
import random

from portrl.data.arith import GENERATOR_VERSION, in_test_split  # noqa: F401  (its problems are arith's: one version)
from portrl.data.schema import DataError, make_row

DATA_SOURCE = "arith_tool"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calculator"
MAX_DIFFICULTY = 10


def operand_digits(difficulty: int) -> tuple[int, int]:
    """(fewest, most) digits of each operand at ``difficulty``."""
    return difficulty + 2, difficulty + 3


def sample_expression(rng: random.Random, difficulty: int) -> tuple[str, int]:
    """One expression ``"a*b"`` of the given difficulty and its exact value."""
    low, high = operand_digits(difficulty)
    a, b = (rng.randrange(10 ** (d - 1), 10 ** d) for d in (rng.randint(low, high), rng.randint(low, high)))
    return f"{a}*{b}", a * b


def prompt_text(expression: str) -> str:
    """The user message of a problem."""
    return f"Compute {expression}."


def tool_call_text(expression: str) -> str:
    """The assistant's calculator call in the hermes format (``<tool_call>`` JSON ``</tool_call>``)."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def answer_text(value: int | str) -> str:
    """The assistant's final answer in the format portrl.rewards.arith_tool scores."""
    return f"<answer>{value}</answer>"


def arith_tool_problems(n: int, seed: int, difficulty: int = 1, split: str = "train",
                        test_fraction: float = 0.1) -> list[tuple[str, int]]:
    """n distinct (expression, value) pairs of one split."""
    if not 1 <= int(difficulty) <= MAX_DIFFICULTY:
        raise DataError(f"arith_tool difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    if split not in ("train", "test"):
        raise DataError(f"arith_tool split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    rng = random.Random(f"arith_tool:{seed}:{difficulty}:{split}")
    want_test = split == "test"
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for _ in range(200 * n + 10000):
        if len(out) >= n:
            break
        expression, value = sample_expression(rng, int(difficulty))
        if expression in seen or in_test_split(expression, test_fraction) != want_test:
            continue
        seen.add(expression)
        out.append((expression, value))
    if len(out) < n:
        raise DataError(f"cannot draw {n} distinct {split} arith_tool problems (found {len(out)}); ask for fewer")
    return out


def _row(expression: str, value: int, split: str, index: int, difficulty: int) -> dict:
    row = make_row(DATA_SOURCE, prompt_text(expression), str(value), split, index, difficulty=int(difficulty),
                   tools_kwargs={TOOL_NAME: {"create_kwargs": {"ground_truth": str(value)}}})
    row["agent_name"] = AGENT_NAME
    return row


def make_arith_tool_rows(n: int, seed: int, difficulty: int = 1, split: str = "train",
                         test_fraction: float = 0.1) -> list[dict]:
    """n verl multi-turn rows of the task (see the module docstring)."""
    return [_row(expression, value, split, i, difficulty)
            for i, (expression, value) in enumerate(arith_tool_problems(n, seed, difficulty, split, test_fraction))]


def make_arith_tool_sft_rows(n: int, seed: int, difficulty: int = 1, split: str = "train",
                             test_fraction: float = 0.1) -> list[dict]:
    """The same rows as make_arith_tool_rows plus ``response``: the ideal conversation after the prompt
    (assistant tool call, tool result, assistant answer; module docstring)."""
    rows = []
    for i, (expression, value) in enumerate(arith_tool_problems(n, seed, difficulty, split, test_fraction)):
        row = _row(expression, value, split, i, difficulty)
        row["response"] = [{"role": "assistant", "content": tool_call_text(expression)},
                           {"role": "tool", "content": str(value)},
                           {"role": "assistant", "content": answer_text(value)}]
        rows.append(row)
    return rows
