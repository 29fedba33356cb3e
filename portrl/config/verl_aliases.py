"""verl's names of the mesh sizes and of the memory levers portrl has, accepted in the config file a user passes (``--config``) and in overrides.

A verl recipe sets ``actor_rollout_ref.actor.ulysses_sequence_parallel_size=4``; portrl's key is
``actor.sequence_parallel_size``. :func:`apply_aliases` moves each name of :data:`ALIASES` to its portrl key before the
keys are checked (portrl.config.keys.check_keys), so every other key verl has and portrl does not is still refused
as unknown. One layer (the file; the command line's overrides together) that sets a verl name and its portrl key to
different values is an error; between layers the later wins, as for any key (an override over the file).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from portrl.config.presets import ConfigError

#: verl's dotted name -> portrl's key
ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "actor.tensor_parallel_size",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "actor.fsdp_size",
    "critic.megatron.tensor_model_parallel_size": "critic.tensor_parallel_size",
    "critic.ulysses_sequence_parallel_size": "critic.sequence_parallel_size",
    "critic.model.fsdp_config.fsdp_size": "critic.fsdp_size",
    "reward_model.megatron.tensor_model_parallel_size": "reward_model.model.tensor_parallel_size",
    "reward_model.ulysses_sequence_parallel_size": "reward_model.model.sequence_parallel_size",
    "reward_model.model.fsdp_config.fsdp_size": "reward_model.model.fsdp_size",
    # the memory levers portrl has (portrl plan says which phases each lowers)
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "actor.offload.params",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "actor.offload.optimizer",
    "actor_rollout_ref.model.enable_activation_offload": "actor.offload.activations",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "ref.param_offload",
    "critic.model.fsdp_config.param_offload": "critic.offload.params",
    "critic.model.fsdp_config.optimizer_offload": "critic.offload.optimizer",
    "critic.model.enable_activation_offload": "critic.offload.activations",
}

_MISSING = object()


def _get(data: Any, dotted: str) -> Any:
    """The value at ``dotted`` in nested mappings, or ``_MISSING``."""
    node = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(data: dict, dotted: str) -> Any:
    """Remove ``dotted`` from nested dicts, and the parents it leaves empty; its value, or ``_MISSING``."""
    head, _, leaf = dotted.partition(".")
    if head not in data:
        return _MISSING
    if not leaf:
        return data.pop(head)
    child = data[head]
    value = _pop(child, leaf) if isinstance(child, dict) else _MISSING
    if isinstance(child, dict) and not child:
        del data[head]
    return value


def _put(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return  # a group given as a scalar: merging it reports the wrong type
    node[leaf] = value


def rewrite(data: Any, source: str) -> tuple[Any, dict[str, str]]:
    """``data`` (nested mappings, not changed) with each verl name moved to its portrl key, and ``{portrl key: verl
    name}`` of those moved. ConfigError (one line, naming ``source``) when ``data`` also sets the portrl key to
    another value. Anything but a mapping comes back as it is."""
    if not isinstance(data, Mapping):
        return data, {}
    out = copy.deepcopy(dict(data))
    moved: dict[str, str] = {}
    for alias, key in ALIASES.items():
        value = _pop(out, alias)
        if value is _MISSING:
            continue
        current = _get(out, key)
        if current is not _MISSING and current != value:
            raise ConfigError(f"{source}: {alias}={value} (verl's name for {key}) and {key}={current} set it to two "
                              "values; give one of them")
        _put(out, key, value)
        moved[key] = alias
    return out, moved


def apply_aliases(user: Any, user_source: str,
                  items: list[tuple[str, dict]]) -> tuple[Any, list[tuple[str, dict]]]:
    """The user's config file and the overrides (``(source, nested mapping)`` each) with verl's names moved to
    portrl's keys (:func:`rewrite`); ConfigError when an override names a key by verl's name and another override
    sets the same key by portrl's name to another value."""
    user, _ = rewrite(user, user_source)
    out: list[tuple[str, dict]] = []
    by_alias: dict[str, tuple[str, Any]] = {}  # portrl key -> (the last override that set it by verl's name, value)
    by_key: dict[str, tuple[str, Any]] = {}  # ... by portrl's name
    for source, item in items:
        item, moved = rewrite(item, source)
        for key in ALIASES.values():
            value = _get(item, key)
            if value is not _MISSING:
                (by_alias if key in moved else by_key)[key] = (source, value)
        out.append((source, item))
    for key, (source, value) in by_alias.items():
        if key in by_key and by_key[key][1] != value:
            raise ConfigError(f"{source} (verl's name for {key}) and {by_key[key][0]} set it to two values; give one "
                              "of them")
    return user, out
