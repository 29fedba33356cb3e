"""Rollout: the RolloutEngine contract, engine selection, and the ``hf`` engine that runs everywhere.

``make_engine(name, model=..., model_path=..., tokenizer=..., backend=...)`` builds an engine;
``engine.generate(prompts, SamplingParams(...)) -> RolloutOutput``; ``engine.update_weights(named)``;
``engine.sleep()`` / ``engine.wake()``. Log-probs are ``log_softmax(logits / temperature)`` at the
sampled token (see :mod:`portrl.rollout.types`).
"""

from portrl.rollout.engine import RolloutEngine, check_prompts
from portrl.rollout.registry import (
    RolloutEngineError,
    available_engines,
    engine_factory,
    engine_names,
    make_engine,
    register_engine,
)
from portrl.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

__all__ = [
    "FINISH_LENGTH", "FINISH_STOP", "RolloutEngine", "RolloutEngineError", "RolloutOutput", "SamplingParams",
    "available_engines", "check_prompts", "engine_factory", "engine_names", "make_engine", "register_engine",
]
