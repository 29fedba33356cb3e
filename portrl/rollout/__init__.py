"""Rollout: the RolloutEngine contract, engine selection, and the ``hf`` engine that runs everywhere.

``choose_engine(requested, backend, num_params=...)`` decides which engine a run uses;
``make_engine(name, model=..., model_path=..., tokenizer=..., backend=..., settings=RolloutSettings(...))``
builds it;
``engine.generate(prompts, SamplingParams(...)) -> RolloutOutput``; ``engine.update_weights(named)``;
``engine.sleep()`` / ``engine.wake()``. Log-probs are ``log_softmax(logits / temperature)`` at the
sampled token (see :mod:`portrl.rollout.types`).
"""

from portrl.rollout.engine import EngineCapabilities, RolloutEngine, check_prompts
from portrl.rollout.registry import (
    SMALL_MODEL_PARAMS,
    RolloutEngineError,
    available_engines,
    broken_engines,
    choose_engine,
    engine_capabilities,
    engine_factory,
    engine_names,
    make_engine,
    offered_engines,
    register_engine,
)
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams

__all__ = [
    "FINISH_ABORT", "FINISH_LENGTH", "FINISH_STOP", "SMALL_MODEL_PARAMS", "EngineCapabilities", "RolloutEngine", "RolloutEngineError",
    "RolloutOutput", "RolloutSettings", "SamplingParams", "available_engines", "broken_engines", "check_prompts",
    "choose_engine", "engine_capabilities", "engine_factory", "engine_names", "make_engine", "offered_engines",
    "register_engine",
]
