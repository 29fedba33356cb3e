"""RLDataset and SFTDataset over parquet, with a char-level tokenizer built here."""

import string

import pytest
import torch

from portrl.data import DataError, RLDataset, SFTDataset, make_arith_rows, make_arith_sft_rows, write_split


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"])
    t.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return t


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def rows_with_prompts(contents):
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": c}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i, c in enumerate(contents)]


def test_prompts_use_chat_template_and_left_padding(tmp_path, tok):
    path = write_split(rows_with_prompts(["1+1=", "12+34="]), tmp_path / "a.parquet")
    ds = RLDataset(path, tok, max_prompt_length=64, shuffle=False)
    batch = next(ds.batches(2))
    assert tok.decode(batch.prompt_ids[0]) == "<|user|>1+1=<|end|><|assistant|>"
    assert len(batch.prompt_ids[0]) == 7 and len(batch.prompt_ids[1]) == 9
    assert batch.input_ids.shape == (2, 9) and batch.input_ids.dtype == torch.long
    assert batch.input_ids[0, :2].tolist() == [tok.pad_token_id] * 2
    assert batch.attention_mask.tolist() == [[0, 0] + [1] * 7, [1] * 9]
    assert batch.input_ids[0, 2:].tolist() == batch.prompt_ids[0]
    assert batch.data_source == ["arith", "arith"] and batch.ground_truth == ["0", "1"]
    assert batch.extra_info[1] == {"split": "train", "index": 1}
    assert batch.uid == ["e0-r0", "e0-r1"] and len(batch) == 2
    padded = RLDataset(path, tok, max_prompt_length=16, shuffle=False, pad_to_max_length=True)
    assert next(padded.batches(2)).input_ids.shape == (2, 16)


def test_several_files_and_arith_rows(tmp_path, tok):
    a = write_split(make_arith_rows(30, seed=1), tmp_path / "a.parquet")
    b = write_split(rows_with_prompts(["x"] * 5), tmp_path / "b.parquet")
    ds = RLDataset([a, b], tok, max_prompt_length=32)
    assert ds.num_rows == 35 and len(ds) == 35


def test_overlong_filter_and_truncation(tmp_path, tok):
    path = write_split(rows_with_prompts(["1", "1234567890"]), tmp_path / "a.parquet")  # 4 and 13 tokens
    assert RLDataset(path, tok, max_prompt_length=10).num_rows == 1
    with pytest.raises(DataError, match=r"a.parquet: row 1: prompt has 13 tokens > max_prompt_length 10"):
        RLDataset(path, tok, max_prompt_length=10, filter_overlong_prompts=False, truncation="error")
    left = RLDataset(path, tok, max_prompt_length=10, filter_overlong_prompts=False, truncation="left", shuffle=False)
    right = RLDataset(path, tok, max_prompt_length=10, filter_overlong_prompts=False, truncation="right", shuffle=False)
    assert tok.decode(next(left.batches(2)).prompt_ids[1]) == "34567890<|end|><|assistant|>"
    assert tok.decode(next(right.batches(2)).prompt_ids[1]) == "<|user|>123456789"
    with pytest.raises(DataError, match="empty after filtering"):
        RLDataset(path, tok, max_prompt_length=3)
    with pytest.raises(ValueError, match="truncation must be one of error, left, right"):
        RLDataset(path, tok, truncation="middle")


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r.pop("data_source"), "'data_source' is missing"),
    (lambda r: r.update(prompt="just text"), "'prompt' must be a non-empty list"),
    (lambda r: r.update(prompt=[{"role": "user", "content": 3}]), r"'prompt\[0\]' must be a message"),
    (lambda r: r.update(reward_model={"style": "rule"}), "'reward_model.ground_truth' is missing"),
    (lambda r: r.update(reward_model={"style": "rule", "ground_truth": ["a"]}), "'reward_model.ground_truth' must be"),
    (lambda r: r.update(extra_info="x"), "'extra_info' must be a struct"),
])
def test_bad_row_names_file_row_and_field(tmp_path, tok, mutate, field):
    rows = rows_with_prompts(["1", "2", "3"])
    bad = [dict(r) for r in rows]
    mutate(bad[2])
    write_split(rows[:2], tmp_path / "good.parquet")
    # one row per file so that pyarrow keeps each row's own (bad) types
    write_split([bad[2]], tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet: row 0: field " + field):
        RLDataset([tmp_path / "good.parquet", tmp_path / "bad.parquet"], tok)


def test_missing_file_and_batch_size(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        RLDataset(tmp_path / "nope.parquet", tok)
    path = write_split(rows_with_prompts(["1", "2"]), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="batch_size must be in 1..2"):
        next(RLDataset(path, tok).batches(3))


def test_shuffle_is_seeded_and_resumable(tmp_path, tok):
    path = write_split(make_arith_rows(10, seed=0), tmp_path / "a.parquet")
    def take(ds, k):
        it = ds.batches(3)
        return [next(it).uid for _ in range(k)]
    full = take(RLDataset(path, tok, seed=5), 7)  # 3 batches per epoch (10 // 3), so this spans 3 epochs
    assert full == take(RLDataset(path, tok, seed=5), 7)
    assert full != take(RLDataset(path, tok, seed=6), 7)
    epoch0 = [u for b in full[:3] for u in b]
    assert len(set(epoch0)) == 9 and all(u.startswith("e0-") for u in epoch0)
    assert all(u.startswith("e1-") for b in full[3:6] for u in b)
    epoch1 = [u for b in full[3:6] for u in b]
    assert [u[3:] for u in epoch1] != [u[3:] for u in epoch0]  # each epoch has its own permutation
    first = RLDataset(path, tok, seed=5)
    it = first.batches(3)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["position"] == 3
    resumed = RLDataset(path, tok, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 3) == full[4:7]
    with pytest.raises(ValueError, match="seed=5 but this dataset has 6"):
        RLDataset(path, tok, seed=6).load_state_dict(state)


def test_no_shuffle_keeps_file_order(tmp_path, tok):
    path = write_split(rows_with_prompts(list("abcd")), tmp_path / "a.parquet")
    assert next(RLDataset(path, tok, shuffle=False).batches(4)).ground_truth == ["0", "1", "2", "3"]


def test_sft_dataset(tmp_path, tok):
    path = write_split(make_arith_sft_rows(6, seed=0), tmp_path / "sft.parquet")
    ds = SFTDataset(path, tok, max_length=32)
    assert len(ds) == 6
    ex = ds[0]
    assert tok.decode(ex.prompt_ids).startswith("<|user|>") and tok.decode(ex.prompt_ids).endswith("<|assistant|>")
    assert ex.response_ids[-1] == tok.eos_token_id
    answer = make_arith_sft_rows(6, seed=0)[0]["response"]
    assert tok.decode(ex.response_ids[:-1]) == answer
    batches = list(ds.batches(4, seed=0))
    assert [len(b.examples) for b in batches] == [4, 2]
    b = batches[0]
    e = b.examples[0]
    n, p = len(e.prompt_ids) + len(e.response_ids), len(e.prompt_ids)
    assert b.input_ids[0, :n].tolist() == e.prompt_ids + e.response_ids
    assert b.loss_mask[0].tolist() == [0] * p + [1] * (n - p) + [0] * (b.input_ids.shape[1] - n)
    assert b.attention_mask[0].sum().item() == n
    longest = max(len(e.prompt_ids) + len(e.response_ids) for e in ds.examples)
    with pytest.raises(DataError, match=f"prompt \\+ response has {longest} tokens > max_length {longest - 1}"):
        SFTDataset(path, tok, max_length=longest - 1)
    cut = SFTDataset(path, tok, max_length=longest - 1, truncation="right")
    assert max(len(e.prompt_ids) + len(e.response_ids) for e in cut.examples) == longest - 1
    write_split([{"prompt": [{"role": "user", "content": "1+1="}], "response": 2}], tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet: row 0: field 'response' must be a string"):
        SFTDataset(tmp_path / "bad.parquet", tok, max_length=32)


def test_float_ground_truth_scores_as_the_number_it_is(tmp_path, tok):
    """A parquet float column holds 57 as 57.0: the row keeps "57", and every integer reward scores it right."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from portrl.rewards import compute_score

    rows = rows_with_prompts(["50+7=", "1+1.5="])
    rows[0]["reward_model"]["ground_truth"], rows[1]["reward_model"]["ground_truth"] = 57.0, 2.5
    path = tmp_path / "f.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = RLDataset(str(path), tok, max_prompt_length=64, shuffle=False)
    truths = next(ds.batches(2)).ground_truth
    assert truths == ["57", "2.5"]
    for source, response in (("arith", "50+7=57"), ("gsm8k", "so #### 57"), ("math_dapo", "Answer: 57")):
        assert compute_score(source, response, 57.0)["score"] == 1.0, source
        assert compute_score(source, response, truths[0])["score"] == 1.0, source
    assert compute_score("arith", "57", "57.0")["score"] == 1.0  # a string of a whole float too
    assert compute_score("arith", "57", "57.5")["score"] == 0.0
