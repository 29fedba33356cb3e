"""The built-in word-problem task ``wordprob``: multi-step arithmetic stories with worked answers in GSM8K's format,
generated offline and deterministic by seed.

Prompt: one user message, a short story and a question, e.g.::

    Mia has 4 boxes of 7 pens. She buys 3 more. She gives away 5. How many pens does she have now?

SFT response (the worked solution, one line per step, the final answer after ``####`` as in GSM8K)::

    4 boxes of 7 is 4*7=28 pens.
    Buys 3: 28+3=31.
    Gives away 5: 31-5=26.
    #### 26

Every problem starts with ``a`` containers of ``b`` items (``a``, ``b`` in 2..9: a product below 100), then adds or
removes one or two single-digit counts (never below 0); every intermediate number is below 100, so each step is
as hard as arith's level 1 plus the one-digit times table. The ground truth is the final count; data_source
``wordprob``, scored by the GSM8K reward (portrl.rewards.gsm8k: the number after the last ``####``).

Difficulty (1-3): the number of +/- steps after the product: 1: one (two steps in all); 2: one or two, half each;
3: two (the ``data=wordprob`` preset's level). Worked answers are 48-62 characters at level 1, 48-85 at 2, 64-85 at
3, within :data:`MIN_ANSWER_CHARS` to :data:`MAX_ANSWER_CHARS` (tokens of the tiny model: one per byte; fewer with a
BPE vocabulary).

Splits are disjoint whatever the seeds, and by the arithmetic, not only the wording: a problem belongs to the test
split when a CRC32 of its skeleton (the numbers and operations, ``"4*7+3-5"``) falls below ``test_fraction`` of the
32-bit range, so no test computation occurs in training under any names, items or verbs.
"""

from __future__ import annotations

import random

from portrl.data.arith import in_test_split
from portrl.data.schema import DataError, make_row

DATA_SOURCE = "wordprob"
#: bumped whenever the generated problems change, so caches of generated files are rebuilt
GENERATOR_VERSION = 1
MAX_DIFFICULTY = 3
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 30, 100

PEOPLE = (("Mia", "She"), ("Tom", "He"), ("Ann", "She"), ("Ben", "He"), ("Zoe", "She"), ("Sam", "He"),
          ("Lily", "She"), ("Max", "He"))
CONTAINERS = ("boxes", "bags", "packs", "jars", "crates")
ITEMS = ("pens", "apples", "cards", "eggs", "books", "shells", "stamps", "beads")
#: (verb in the story, the same in the worked answer's line); the story adds "more" after a gain
GAINS = (("buys", "Buys"), ("finds", "Finds"), ("gets", "Gets"))
LOSSES = (("gives away", "Gives away"), ("loses", "Loses"), ("sells", "Sells"))


def _steps(rng: random.Random, difficulty: int) -> int:
    """How many +/- steps follow the product at this difficulty."""
    return 1 if difficulty == 1 else 2 if difficulty == 3 else rng.choice((1, 2))


def sample_problem(rng: random.Random, difficulty: int) -> tuple[str, str, str, int]:
    """(skeleton, prompt, worked answer, final value) of one problem of the given difficulty."""
    name, pron = rng.choice(PEOPLE)
    box, item = rng.choice(CONTAINERS), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    value = a * b
    skeleton = f"{a}*{b}"
    story = [f"{name} has {a} {box} of {b} {item}."]
    lines = [f"{a} {box} of {b} is {a}*{b}={value} {item}."]
    for _ in range(_steps(rng, difficulty)):
        gain = value < 2 or rng.random() < 0.5
        c = rng.randint(1, 9) if gain else rng.randint(1, min(9, value - 1))
        verb, line_verb = rng.choice(GAINS if gain else LOSSES)
        new = value + c if gain else value - c
        op = "+" if gain else "-"
        story.append(f"{pron} {verb} {c}{' more' if gain else ''}.")
        lines.append(f"{line_verb} {c}: {value}{op}{c}={new}.")
        skeleton += f"{op}{c}"
        value = new
    story.append(f"How many {item} does {pron.lower()} have now?")
    lines.append(f"#### {value}")
    return skeleton, " ".join(story), "\n".join(lines), value


def wordprob_problems(n: int, seed: int, difficulty: int = 2, split: str = "train",
                      test_fraction: float = 0.1) -> list[tuple[str, str, int]]:
    """n distinct (prompt, worked answer, final value) triples of one split."""
    if not 1 <= int(difficulty) <= MAX_DIFFICULTY:
        raise DataError(f"wordprob difficulty must be in 1..{MAX_DIFFICULTY}, got {difficulty}")
    if split not in ("train", "test"):
        raise DataError(f"wordprob split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = random.Random(f"wordprob:{seed}:{difficulty}:{split}")
    want_test = split == "test"
    out: list[tuple[str, str, int]] = []
    seen: set[str] = set()
    for _ in range(200 * n + 10000):
        if len(out) >= n:
            break
        skeleton, prompt, answer, value = sample_problem(rng, int(difficulty))
        if prompt in seen or in_test_split(skeleton, test_fraction) != want_test:
            continue
        seen.add(prompt)
        out.append((prompt, answer, value))
    if len(out) < n:
        raise DataError(f"cannot draw {n} distinct {split} wordprob problems at difficulty {difficulty} "
                        f"(found {len(out)}); ask for fewer")
    return out


def make_wordprob_rows(n: int, seed: int, difficulty: int = 2, split: str = "train",
                       test_fraction: float = 0.1) -> list[dict]:
    """n verl-schema rows of the task (module docstring); extra_info keeps the question and the worked answer, as
    portrl's GSM8K rows do."""
    return [make_row(DATA_SOURCE, prompt, str(value), split, i, difficulty=int(difficulty), question=prompt,
                     answer=answer)
            for i, (prompt, answer, value) in enumerate(wordprob_problems(n, seed, difficulty, split, test_fraction))]


def make_wordprob_sft_rows(n: int, seed: int, difficulty: int = 2, split: str = "train",
                           test_fraction: float = 0.1) -> list[dict]:
    """The same rows as make_wordprob_rows plus ``response``: the worked answer ending in ``#### N`` (for SFT)."""
    rows = make_wordprob_rows(n, seed, difficulty, split, test_fraction)
    for row in rows:
        row["response"] = row["extra_info"]["answer"]
    return rows
