"""Environment turns: an :class:`Interaction` answers a model turn that made no tool call, as a user would (verl's
``interaction_config_path`` and the row's ``extra_info.interaction_kwargs``, read unchanged).

A row whose ``interaction_kwargs`` names an interaction (``{"name": "reward_feedback", "ground_truth": ...}``) gets,
after each model turn without a tool call, :meth:`Interaction.respond` with the conversation so far and those kwargs:
an :class:`InteractionReply` with the text the model reads next (a user message; its tokens are environment tokens,
mask 0), a reward for the turn just ended (the trajectory's ``turn_rewards``), and ``done`` to end the trajectory.
``rollout.multi_turn.max_user_turns`` bounds the replies.

The config (YAML, verl's format)::

    interaction:
      - name: feedback                  # what a row's interaction_kwargs.name picks
        class_name: reward_feedback     # a built-in, or pkg.mod.Name / pkg.mod:Name of an Interaction subclass
        config: {feedback: "Not correct yet. Check your work and answer again."}

Built in: ``reward_feedback`` (verl's gsm8k interaction for any data source): the last model turn is scored by the
row's reward function (portrl/rewards/registry.py, ``data_source`` and ``ground_truth`` from the kwargs); the score
is the turn's reward; a score >= ``threshold`` ends the trajectory, any other gets ``feedback``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from portrl.errors import UserError
from portrl.rewards.registry import compute_score

BUILTIN_INTERACTIONS = {"reward_feedback": "portrl.agent.interactions:RewardFeedback"}


class InteractionConfigError(UserError, ValueError):
    """An interaction config that cannot be read (one line naming the file and the entry)."""


@dataclass
class InteractionReply:
    text: str
    reward: float = 0.0
    done: bool = False


class Interaction:
    """Base class of environment turns (module docstring); built with the entry's ``config`` as keywords."""

    def respond(self, messages: List[Dict[str, Any]], kwargs: Dict[str, Any]) -> InteractionReply:
        raise NotImplementedError(f"{type(self).__name__} does not implement respond")


class RewardFeedback(Interaction):
    """Scores the last model turn with the row's reward function; feedback until the score reaches ``threshold``."""

    def __init__(self, feedback: str = "Your answer is not correct. Check your work and answer again.",
                 threshold: float = 1.0):
        self.feedback, self.threshold = str(feedback), float(threshold)

    def respond(self, messages: List[Dict[str, Any]], kwargs: Dict[str, Any]) -> InteractionReply:
        answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
        result = compute_score(str(kwargs.get("data_source", "")), answer, kwargs.get("ground_truth", ""), kwargs)
        score = float(result["score"] if isinstance(result, dict) else result)
        done = score >= self.threshold
        return InteractionReply("" if done else self.feedback, reward=score, done=done)


def load_interaction_config(path: "str | Path") -> Dict[str, Interaction]:
    """name -> Interaction of a config file (module docstring); :class:`InteractionConfigError` on any mistake."""
    file = Path(path).expanduser()
    where = f"interaction config {str(path)!r}"
    if not file.is_file():
        raise InteractionConfigError(f"{where} does not exist (rollout.multi_turn.interaction_config_path)")
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InteractionConfigError(f"{where} is not valid YAML ({' '.join(str(exc).split())})") from None
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InteractionConfigError(f"{where} has no 'interaction' list (entries with name, class_name, config)")
    out: Dict[str, Interaction] = {}
    for k, entry in enumerate(entries):
        at = f"{where}: interaction[{k}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise InteractionConfigError(f"{at} needs class_name (a built-in: {', '.join(BUILTIN_INTERACTIONS)}, "
                                         "or pkg.mod.Name of an Interaction subclass)")
        unknown = sorted(set(entry) - {"name", "class_name", "config"})
        if unknown:
            raise InteractionConfigError(f"{at} has unknown keys {unknown}; valid: name, class_name, config")
        cls = _resolve(entry["class_name"], at)
        name = str(entry.get("name") or entry["class_name"])
        if name in out:
            raise InteractionConfigError(f"{at}: a second interaction named {name!r}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{at}: config is a {type(config).__name__}, not a mapping")
        try:
            out[name] = cls(**config)
        except TypeError as exc:
            raise InteractionConfigError(f"{at}: {entry['class_name']} cannot be built with {sorted(config)} "
                                         f"({exc})") from None
    return out


def _resolve(target: str, where: str) -> type:
    path = BUILTIN_INTERACTIONS.get(target, target)
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr) if module else None
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's config
        raise InteractionConfigError(f"{where}: cannot import {path!r} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(obj, type) and issubclass(obj, Interaction)):
        raise InteractionConfigError(f"{where}: {target!r} is not an Interaction subclass; built-ins: "
                                     f"{', '.join(BUILTIN_INTERACTIONS)}")
    return obj


def row_interaction(interactions: Dict[str, Interaction], extra_info: Optional[Dict[str, Any]],
                    data_source: str) -> Optional[tuple]:
    """``(Interaction, kwargs)`` a row's ``extra_info.interaction_kwargs`` picks (its ``data_source`` added when the
    kwargs lack one), or None when the row has none; an unknown name is a UserError naming the valid ones."""
    kwargs = (extra_info or {}).get("interaction_kwargs")
    if not kwargs:
        return None
    name = kwargs.get("name") if isinstance(kwargs, dict) else None
    if name not in interactions:
        valid = ", ".join(interactions) or "(none: set rollout.multi_turn.interaction_config_path)"
        raise UserError(f"a data row's extra_info.interaction_kwargs names interaction {name!r}; valid: {valid}")
    return interactions[name], {"data_source": data_source, **kwargs}
