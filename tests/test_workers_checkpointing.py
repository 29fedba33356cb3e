"""model.gradient_checkpointing=null decides by model size (portrl.workers.setup.use_gradient_checkpointing): on
from 100M parameters, counted from config.json on the meta device (Qwen2.5-0.5B's architecture: 494M), off for the
tiny model; an explicit true / false is kept."""

from omegaconf import OmegaConf

from portrl.config.options_schema import default_config
from portrl.workers.setup import AUTO_CHECKPOINTING_PARAMS, count_parameters, use_gradient_checkpointing


def _cfg(flag):
    cfg = default_config()
    OmegaConf.update(cfg, "model.gradient_checkpointing", flag)
    return cfg


def test_auto_checkpointing_by_parameter_count(tmp_path):
    from transformers import Qwen2Config

    from portrl.models import write_tiny_model

    qwen = tmp_path / "qwen2.5-0.5b"  # the exact architecture, config only: nothing is allocated
    Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(qwen)
    tiny = write_tiny_model(tmp_path / "tiny")
    assert count_parameters(qwen) == 494_032_768 and count_parameters(tiny) < AUTO_CHECKPOINTING_PARAMS
    assert default_config().model.gradient_checkpointing is None
    assert use_gradient_checkpointing(_cfg(None), str(qwen)) is True
    assert use_gradient_checkpointing(_cfg(None), str(tiny)) is False
    assert use_gradient_checkpointing(_cfg(False), str(qwen)) is False
    assert use_gradient_checkpointing(_cfg(True), str(tiny)) is True


def test_presets_leave_it_to_the_size_or_set_it():
    from portrl.config import compose

    assert compose(preset="cpu", overrides=["model=qwen2.5-0.5b"]).model.gradient_checkpointing is None  # -> on
    assert compose(preset="h100", overrides=["model=qwen2.5-0.5b"]).model.gradient_checkpointing is True
    assert compose(preset="cpu", overrides=["model=tiny"]).model.gradient_checkpointing is False
