"""write_tiny_model / load_tokenizer: a real local HF model + tokenizer, and clear errors for bad paths."""

import json

import pytest
import torch

from portrl.models import load_causal_lm, load_tokenizer, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_tiny_model_files_and_config(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2
    tok = load_tokenizer(tiny)
    assert 100 <= len(tok) <= cfg["vocab_size"] <= 300
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token == "<|endoftext|>"


def test_tokenizer_digits_chat_template_roundtrip(tiny):
    tok = load_tokenizer(tiny)
    ids = tok("What is 12+7? Answer: 19", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("What is 12+7? Answer: 19")
    assert [tok.decode([i]) for i in tok("1234567890", add_special_tokens=False)["input_ids"]] == list("1234567890")
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3*4-5?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3*4-5?<|im_end|>\n<|im_start|>assistant\n"
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert enc[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(enc) == text
    assert tok.decode(enc, skip_special_tokens=True) == "user\nWhat is 3*4-5?\nassistant\n"


def test_same_seed_same_weights_and_overwrite(tmp_path):
    a = write_tiny_model(tmp_path / "a", hidden_size=32, num_heads=4, num_kv_heads=1, seed=3)
    b = write_tiny_model(tmp_path / "b", hidden_size=32, num_heads=4, num_kv_heads=1, seed=3)
    ma, mb = load_causal_lm(a, backend="cpu"), load_causal_lm(b, backend="cpu")
    for (n, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_tiny_model(a)
    write_tiny_model(a, hidden_size=32, num_heads=4, num_kv_heads=1, seed=4, overwrite=True)
    assert not torch.equal(load_causal_lm(a, backend="cpu").lm_head.weight, ma.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dirs left behind


def test_missing_and_invalid_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*local directories only"):
        load_causal_lm(tmp_path / "nope", backend="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_causal_lm(tmp_path / "empty", backend="cpu")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="valid: float32"):
        load_causal_lm(write_tiny_model(tmp_path / "t"), dtype="float8", backend="cpu")
    with pytest.raises(ValueError, match="unknown tiny vocabulary"):
        write_tiny_model(tmp_path / "v", vocab="klingon")
