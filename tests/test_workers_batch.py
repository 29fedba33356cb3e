"""Batch container: select / chunk / split / concat / union, rollout layout and re-padding."""

import pytest
import torch

from portrl.workers.batch import Batch, build_rollout_batch, concat_rollouts, pad_rollout


def _batch(n=5):
    return Batch({"x": torch.arange(n * 2).reshape(n, 2)}, {"uid": [f"u{i}" for i in range(n)]}, {"k": 1})


def test_select_chunk_split_concat_roundtrip():
    b = _batch(5)
    assert len(b) == 5 and b["uid"][2] == "u2" and torch.equal(b["x"][1], torch.tensor([2, 3]))
    s = b.select([4, 0])
    assert s["uid"] == ["u4", "u0"] and s["x"][0].tolist() == [8, 9] and s.info == {"k": 1}
    m = b.select(torch.tensor([True, False, True, False, False]))
    assert m["uid"] == ["u0", "u2"]
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    assert [len(p) for p in b.split(2)] == [2, 2, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["uid"] == b["uid"]


def test_row_count_and_union_conflicts_are_errors():
    b = _batch(3)
    with pytest.raises(ValueError, match="rows"):
        b["y"] = torch.zeros(4)
    with pytest.raises(ValueError, match="same number of rows"):
        Batch({"a": torch.zeros(2)}, {"b": [1, 2, 3]})
    other = Batch({"x": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="different values"):
        b.union(other)
    b.union(Batch({"y": torch.ones(3)}))
    assert "y" in b and b["y"].shape == (3,)
    with pytest.raises(KeyError, match="no key"):
        b["missing"]
    with pytest.raises(ValueError, match="pad_rollout"):
        Batch.concat([Batch({"x": torch.zeros(1, 2)}), Batch({"x": torch.zeros(1, 3)})])


def test_build_rollout_batch_layout():
    b = build_rollout_batch([[1, 2], [3]], [[7, 8, 9], [7], [5, 5], [6]], [[-.1, -.2, -.3], [-.4], [-.5, -.6], [-.7]],
                            pad_token_id=0, n=2, meta={"uid": ["a", "b"]})
    assert b["uid"] == ["a", "a", "b", "b"]
    assert b["prompts"].tolist() == [[1, 2], [1, 2], [0, 3], [0, 3]]
    assert b["responses"].tolist() == [[7, 8, 9], [7, 0, 0], [5, 5, 0], [6, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert b["attention_mask"][2].tolist() == [0, 1, 1, 1, 0]
    assert b["input_ids"][2].tolist() == [0, 3, 5, 5, 0]
    assert b["rollout_log_probs"][2].tolist() == pytest.approx([-.5, -.6, 0.0])


def test_pad_rollout_and_concat_rollouts_keep_layout():
    a = build_rollout_batch([[1, 2, 3]], [[4]], pad_token_id=0)
    b = build_rollout_batch([[5]], [[6, 7]], pad_token_id=0)
    b["values"] = torch.tensor([[0.5, 0.25]])
    a["values"] = torch.tensor([[1.0]])
    c = concat_rollouts([a, b])
    assert c["prompts"].tolist() == [[1, 2, 3], [0, 0, 5]]
    assert c["responses"].tolist() == [[4, 0], [6, 7]]
    assert c["input_ids"].tolist() == [[1, 2, 3, 4, 0], [0, 0, 5, 6, 7]]
    assert c["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert c["values"].tolist() == [[1.0, 0.0], [0.5, 0.25]]
    with pytest.raises(ValueError, match="shrink"):
        pad_rollout(c, 1, 1)
