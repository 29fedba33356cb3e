"""``data=code`` (configs/data/code.yaml) on the code problems shipped with portrl, as examples/code_grpo_tiny.sh
runs it: the preset composes with the tiny default, every shipped prompt fits its max_prompt_length with the tiny
model's tokenizer, the first batch has rows, and the reward gives each row's reference solution full marks."""

from __future__ import annotations

import json
import os

from portrl.config import compose
from portrl.data.code import BUILTIN_PROBLEMS
from portrl.data.preprocess import preprocess
from portrl.models.tokenizer import build_tokenizer
from portrl.rewards.code import CODE_SOURCES
from portrl.rewards.registry import compute_score
from portrl.tasks import TASKS
from portrl.trainer.generation import run_dataset
from portrl.trainer.resources import TINY_VOCAB


def test_the_code_preset_composes_with_the_tiny_default():
    cfg = compose(data="code")
    assert cfg.data.name == "code" and TASKS["code"].preset
    assert cfg.data.train_files == [os.path.expanduser("~/data/code/train.parquet")]
    assert cfg.data.val_files == [os.path.expanduser("~/data/code/test.parquet")]
    assert cfg.model.path is None and cfg.model.size == "tiny"  # the default model
    assert cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0


def test_the_first_batch_of_the_shipped_problems_has_rows_their_references_solve(tmp_path):
    files = preprocess("code", tmp_path / "code")  # no --input: the shipped problems, as the example writes them
    cfg = compose(data="code", overrides=[f"data.train_files=[{files['train']}]",
                                          f"data.val_files=[{files['test']}]"])
    tokenizer = build_tokenizer(TINY_VOCAB)
    train = run_dataset(cfg, [str(files["train"])], tokenizer, None, shuffle=True, seed=0)
    problems = [json.loads(line) for line in BUILTIN_PROBLEMS.read_text().splitlines()]
    assert len(train) == 12 and len(problems) == 13  # no prompt over data.max_prompt_length: none dropped
    batch = next(train.batches(min(int(cfg.data.train_batch_size), len(train))))
    assert len(batch) == min(int(cfg.data.train_batch_size), 12) > 0
    assert max(len(ids) for ids in batch.prompt_ids) <= int(cfg.data.max_prompt_length)
    reference = {p["question"]: p["reference"] for p in problems}
    for i in range(len(batch)):  # every row through the sandbox (~0.4 s each)
        program = "```python\n" + reference[batch.extra_info[i]["question"]] + "```"
        assert len(tokenizer(program)["input_ids"]) < int(cfg.data.max_response_length)
        result = compute_score(batch.data_source[i], program, batch.ground_truth[i], batch.extra_info[i])
        assert isinstance(result, dict) and result["score"] == 1.0, (batch.extra_info[i]["question"], result)
    assert set(batch.data_source) <= set(CODE_SOURCES)
