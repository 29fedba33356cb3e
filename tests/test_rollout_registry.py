"""make_engine: the engine is checked against what the backend offers, the choice is logged, and
bad names or parameters get clear errors."""

from __future__ import annotations

import logging

import pytest
import torch

from portrl.rollout import (
    RolloutEngineError,
    RolloutOutput,
    SamplingParams,
    available_engines,
    engine_names,
    make_engine,
)


class HFOnly:
    name = "testdev"
    device_type = "cpu"

    def rollout_engines(self):
        return ("hf",)

    def check_and_update_engine_options(self, engine, options):
        if engine == "hf":
            options.setdefault("compact_fraction", 0.5)  # a default the caller's keywords may still override
        return options

    def register_kernels(self, registry):  # no kernels of its own: every op takes its native implementation
        pass

    def kernel_preferences(self):
        return {}

    def device(self, index=None):
        return torch.device("cpu")


def tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32, eos_token_id=1))


def test_engines_are_declared():
    assert {"hf", "vllm"} <= set(engine_names())
    assert available_engines(HFOnly()) == ["hf"]


def test_choice_is_logged_and_backend_hook_applied(caplog):
    with caplog.at_level(logging.INFO, logger="portrl.rollout.registry"):
        engine = make_engine("hf", model=tiny(), backend=HFOnly())
    assert "rollout engine hf (requested) on backend testdev" in caplog.text
    assert engine.compact_fraction == 0.5  # the backend's hook
    assert make_engine("hf", model=tiny(), backend=HFOnly(), compact_fraction=0.25).compact_fraction == 0.25


def test_auto_picks_first_available(caplog):
    with caplog.at_level(logging.INFO, logger="portrl.rollout.registry"):
        engine = make_engine("auto", model=tiny(), backend=HFOnly())
    assert engine.name == "hf" and "(auto)" in caplog.text


def test_unavailable_engine_lists_available():
    with pytest.raises(RolloutEngineError, match=r"'vllm' is not available on backend 'testdev' .*available: hf"):
        make_engine("vllm", model_path="/x", backend=HFOnly())
    with pytest.raises(RolloutEngineError, match=r"'nope' is not available .*available: hf"):
        make_engine("nope", backend=HFOnly())


def test_cpu_backend_by_name():
    engine = make_engine("hf", model=tiny(), backend="cpu")
    assert engine.name == "hf" and engine.colocated


def test_hf_engine_needs_a_model():
    with pytest.raises(ValueError, match="model= .* or model_path="):
        make_engine("hf", backend=HFOnly())


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be"),
    ({"temperature": -1.0}, "temperature must be"),
    ({"top_p": 0.0}, "top_p must be"),
    ({"top_k": 0}, "top_k must be -1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_rollout_output_checks_lengths():
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        RolloutOutput([[1, 2]], [[0.0]], ["stop"])
    out = RolloutOutput([[1, 2], [3]], [[0.0, 0.0], [0.0]], ["stop", "length"])
    assert len(out) == 2 and out.num_tokens == 3
