"""The built-in arithmetic task, generated offline and deterministic by seed.

Prompt: one user message holding just the problem, e.g. ``"12+7="``, ``"45-8="``, ``"13*6="``
(operands are non-negative; a negative result is written with a leading '-': ``"3-15="`` -> ``-12``).
Answer: the integer as plain digits; the reward (portrl.rewards.arith) takes the last integer in
the response, so the ideal response is just ``"19"`` followed by EOS. data_source "arith".

Difficulty (1-10):

- 1: a number below 100 plus or minus a single digit (either order for +), results >= 0. Every
  pair of units digits occurs in training, so a tiny model generalises to the held-out problems
  after a short SFT: the level of the built-in demo;
- 2: addition and subtraction of two 1-2 digit numbers, results >= 0 (carries across both digits;
  a 0.4M-parameter model needs thousands of SFT steps here);
- d >= 3: +/- with up to d digits (negative results allowed) and multiplication of a
  ceil((d-1)/2)-digit by a floor((d-1)/2)-digit number.

Splits are disjoint whatever the seeds: a problem belongs to the test split when a CRC32 of its
text falls below ``test_fraction`` of the 32-bit range, and each split samples only its own problems.
"""

from __future__ import annotations

import random
import zlib

from portrl.data.schema import DataError, make_row

DATA_SOURCE = "arith"
#: bumped whenever the generated problems change, so caches of generated files are rebuilt
GENERATOR_VERSION = 2
MAX_DIFFICULTY = 10


def _operands(rng: random.Random, digits: int) -> int:
    return rng.randrange(0, 10 ** digits)


def sample_problem(rng: random.Random, difficulty: int) -> tuple[int, str, int]:
    """(a, op, b) for one problem of the given difficulty."""
    if difficulty <= 2:
        op = rng.choice("+-")
        if difficulty == 1:
            a, b = _operands(rng, 2), _operands(rng, 1)
            if op == "+" and rng.random() < 0.5:
                a, b = b, a
        else:
            a, b = _operands(rng, rng.choice((1, 2))), _operands(rng, rng.choice((1, 2)))
        if op == "-" and b > a:
            a, b = b, a
        return a, op, b
    level = difficulty - 1
    op = rng.choice("+-*")
    if op == "*":
        return _operands(rng, (level + 1) // 2), op, _operands(rng, level // 2)
    return _operands(rng, rng.randint(1, level + 1)), op, _operands(rng, rng.randint(1, level + 1))


def evaluate(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def in_test_split(text: str, test_fraction: float) -> bool:
    """Whether a problem text belongs to the held-out split (fixed by its CRC32)."""
    return zlib.crc32(text.encode()) < test_fraction * 2**32


def arith_problems(n: int, seed: int, difficulty: int = 1, split: str = "train",
                   test_fraction: float = 0.1) -> list[tuple[str, int]]:
    """n distinct (problem text "a+b=", answer) pairs of one split."""
    if not 1 <= int(difficulty) <= MAX_DIFFICULTY:
        raise DataError(f"arith difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    if split not in ("train", "test"):
        raise DataError(f"arith split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    rng = random.Random(f"arith:{seed}:{difficulty}:{split}")
    want_test = split == "test"
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 10000:
            raise DataError(f"cannot draw {n} distinct {split} problems at difficulty {difficulty} "
                             f"(found {len(out)}); ask for fewer or raise the difficulty")
        a, op, b = sample_problem(rng, int(difficulty))
        text = f"{a}{op}{b}="
        if text in seen or in_test_split(text, test_fraction) != want_test:
            continue
        seen.add(text)
        out.append((text, evaluate(a, op, b)))
    return out


def make_arith_rows(n: int, seed: int, difficulty: int = 1, split: str = "train",
                    test_fraction: float = 0.1) -> list[dict]:
    """n verl-schema rows of the arithmetic task (see the module docstring)."""
    return [make_row(DATA_SOURCE, text, str(answer), split, i, difficulty=int(difficulty))
            for i, (text, answer) in enumerate(arith_problems(n, seed, difficulty, split, test_fraction))]


def make_arith_sft_rows(n: int, seed: int, difficulty: int = 1, split: str = "train",
                        test_fraction: float = 0.1) -> list[dict]:
    """The same rows as make_arith_rows plus ``response``: the answer as plain digits (for SFT)."""
    rows = make_arith_rows(n, seed, difficulty, split, test_fraction)
    for row in rows:
        row["response"] = row["reward_model"]["ground_truth"]
    return rows
