"""The algorithm spec: one registered record per advantage estimator and per objective saying what it needs.

An algorithm is the pair of config keys ``algorithm.objective`` and ``algorithm.adv_estimator``;
:func:`algorithm_spec` resolves the pair to one :class:`AlgorithmSpec`. The trainer, the workers and the
config checks read that record (a critic? a reference? old log-probs? Σπ²? a greedy baseline rollout? groups?
pairs?) and call its ``advantages`` and ``loss``; no other layer compares algorithm names.

* :class:`EstimatorSpec` (registry ``adv_estimator``): an advantage estimator ``fn(token_level_rewards,
  response_mask, ...) -> (advantages, returns)`` and its needs. Built-ins are registered where they are
  defined, with the :func:`estimator` decorator: ``portrl/algo/gae.py`` (gae, vcppo_gae, vapo_gae),
  ``portrl/algo/advantages_outcome.py`` (grpo, grpo_passk, rloo, opo, gpg, reinforce_plus_plus_baseline),
  ``portrl/algo/advantages_vectorized.py`` (grpo_vectorized, rloo_vectorized), ``portrl/algo/advantages_gdpo.py``
  (gdpo), ``portrl/algo/advantages_return.py`` (reinforce_plus_plus, remax, optimal_token_baseline),
  ``portrl/algo/advantages_tir.py`` (tir_optimal_token_baseline),
  ``portrl/algo/advantages_prime.py`` (prime).
* :class:`ObjectiveSpec` (registry ``objective``): what the actor optimises: its advantages (through the
  estimator for ``policy_gradient``, its own for sppo and dpo) and its loss. Built-ins (policy_gradient, sppo,
  dpo) are registered in ``portrl/algo/objectives.py``.

Another package adds an estimator with one call, ``register_estimator(EstimatorSpec("td0", fn,
needs_critic=True, options=TD0Options))`` (or the :func:`estimator` decorator), before the config is checked;
nothing else changes: its options (a dataclass, ``portrl/algo/options.py``) become the config keys
``algorithm.<field>`` with their declared ranges, and reach ``fn`` as keywords. A ``needs_*`` field is a bool, or
a function of the ``algorithm`` config section for a need that depends on an option (DPO needs a reference unless
``algorithm.dpo_reference_free``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch

from portrl.algo.options import as_classes, fields_of
from portrl.algo.registry import ADV_ESTIMATORS, OBJECTIVES

Need = Union[bool, Callable[[Any], bool]]
Tensors = Mapping[str, torch.Tensor]
#: ``inputs(options, tensors) -> {keyword: value}``: an estimator's extra arguments from the batch (EstimatorSpec)
InputsFn = Callable[[Mapping[str, Any], Tensors], Dict[str, Any]]
#: ``counts(tensors) -> {name: count}``: an objective's counts over a mini-batch's rows on one rank (ObjectiveSpec)
CountsFn = Callable[[Tensors], Dict[str, float]]
#: keys of the ``algorithm`` section that reach an estimator only when its function names them (``gamma`` reaches
#: gae and reinforce_plus_plus, not grpo); the config refuses one set away from its default for any other estimator
ESTIMATOR_KEYWORDS = ("gamma", "lam", "norm_adv_by_std_in_grpo")
#: ``advantages(algorithm, tensors, index, group_size) -> (new batch tensors, metrics)``
AdvantageFn = Callable[[Any, Tensors, Sequence, int], Tuple[Dict[str, torch.Tensor], Dict[str, float]]]
#: ``loss(actor, algorithm, tensors, logp, old, info) -> (loss, raw metrics)`` on one micro-batch
LossFn = Callable[[Any, Any, Tensors, torch.Tensor, torch.Tensor, Mapping[str, Any]], Tuple[torch.Tensor, Dict]]


@dataclass(frozen=True, kw_only=True)
class Needs:
    """What an estimator or an objective needs, given as keywords; each a bool, or a function of the
    ``algorithm`` config section for a need that depends on an option.

    * ``needs_critic``: reads ``values`` (the critic runs and trains on the returns);
    * ``needs_reference``: reads ``ref_log_probs`` (the frozen reference runs);
    * ``needs_old_log_probs``: reads ``old_log_probs`` (computed even for an on-policy update);
    * ``per_token_rewards``: reads the reward at every token (returns accumulated over t); False: only each
      row's summed reward (outcome estimators), so reward shaping counts only through the sum;
    * ``needs_groups``: compares the responses of one prompt (``index``), so ``rollout.n >= 2``;
    * ``needs_greedy_baseline``: reads ``reward_baselines``, the reward of one greedy response per prompt
      (ReMax), which costs the trainer an extra generation per step;
    * ``needs_sum_pi_squared``: reads ``sum_pi_squared`` (B,T), ``Σ_v π(v | context)²`` of every response token
      under the old policy (verl's ``actor.calculate_sum_pi_squared``), which the old-log-prob pass then computes
      (optimal-token-baseline estimators);
    * ``needs_implicit_rewards``: reads ``implicit_rewards``, the per-token rewards of PRIME's implicit process
      reward model, which the trainer then starts and trains online (``portrl/trainer/prime_phase.py``).
    """

    needs_critic: Need = False
    needs_reference: Need = False
    needs_old_log_probs: Need = False
    per_token_rewards: Need = False
    needs_groups: Need = False
    needs_greedy_baseline: Need = False
    needs_sum_pi_squared: Need = False
    needs_implicit_rewards: Need = False


@dataclass(frozen=True)
class EstimatorSpec(Needs):
    """An advantage estimator (config ``algorithm.adv_estimator``) and what it needs (:class:`Needs`).

    ``fn`` takes the keyword arguments its signature names from what ``portrl.algo.compute_advantage``
    offers (``values``, ``index``, ``reward_baselines``, ``old_log_probs``, ``gamma``, ``lam``, ...).
    ``inputs`` (:data:`InputsFn`): the further arguments ``fn`` reads from the step's batch, given the values of its
    options and the batch tensors (GDPO: its reward components, the tensors ``reward_extra/<key>`` its option
    ``gdpo_reward_keys`` names); the policy-gradient objective passes them, naming no estimator.
    """

    name: str
    fn: Callable
    options: Any = None  # its options classes (portrl.algo.options): keys of the config, passed to fn by name
    inputs: Optional[InputsFn] = None

    def takes(self, option: str) -> bool:
        """Whether ``fn`` takes the keyword ``option`` (e.g. ``lam_actor``)."""
        return option in inspect.signature(self.fn).parameters

    def declares(self, option: str) -> bool:
        """Whether ``option`` is a field of the options this estimator declares."""
        return any(f.name == option for _, f, _ in fields_of(self.options))


@dataclass(frozen=True)
class ObjectiveSpec(Needs):
    """An objective (config ``algorithm.objective``): the actor's loss and what it needs (:class:`Needs`).

    ``advantages`` (:data:`AdvantageFn`) fills the batch tensors ``loss`` reads. ``uses_estimator``: those
    come from ``algorithm.adv_estimator`` (policy gradient), whose needs then add to the objective's;
    otherwise the estimator is not used. ``needs_pairs``: rows come as ``(2k, 2k+1)`` pairs of samples of
    one prompt (``rollout.n`` even). ``options``: its options classes (``portrl.algo.options``), read by its
    functions from the config sections they get. ``uses_policy_loss``: ``loss`` is the policy loss
    ``actor.policy_loss.loss_mode`` (whose options then apply). ``counts`` (:data:`CountsFn`): numbers the loss needs
    over the whole mini-batch (online DPO: its valid pairs); the actor sums them over the ranks and passes them in
    ``info``.
    """

    name: str
    advantages: AdvantageFn
    loss: LossFn
    uses_estimator: bool = False
    needs_pairs: Need = False
    options: Any = None
    uses_policy_loss: bool = False
    counts: Optional[CountsFn] = None

    def declares(self, option: str) -> bool:
        """Whether ``option`` is a field of the options this objective declares."""
        return any(f.name == option for _, f, _ in fields_of(self.options))


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one ``algorithm`` config section needs, resolved (plain bools; see :func:`algorithm_spec`).

    ``needs_reference`` and ``needs_old_log_probs`` include ``algorithm.use_kl_in_reward`` (the KL in the
    reward reads both); ``actor.use_kl_loss`` and the switches ``critic.enable`` / ``ref.enable`` are
    applied by :func:`critic_enabled` and :func:`reference_enabled`.
    """

    objective: ObjectiveSpec
    estimator: Optional[EstimatorSpec]  # None when the objective does not use algorithm.adv_estimator
    needs_critic: bool
    needs_reference: bool
    needs_old_log_probs: bool
    per_token_rewards: bool
    needs_groups: bool
    needs_greedy_baseline: bool
    needs_pairs: bool
    needs_sum_pi_squared: bool = False
    needs_implicit_rewards: bool = False

    def advantages(self, algorithm: Any, tensors: Tensors, index: Sequence,
                   group_size: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        """The new batch tensors (``advantages`` and ``returns``, or the objective's) and metrics."""
        return self.objective.advantages(algorithm, tensors, index, group_size)

    def loss(self, actor: Any, algorithm: Any, tensors: Tensors, logp: torch.Tensor, old: torch.Tensor,
             info: Mapping[str, Any]) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """The objective's loss on one micro-batch and its raw metrics (see :data:`LossFn`)."""
        return self.objective.loss(actor, algorithm, tensors, logp, old, info)

    def counts(self, tensors: Tensors) -> Dict[str, float]:
        """The objective's counts over this rank's rows of a mini-batch (:data:`CountsFn`); empty when it has none."""
        return self.objective.counts(tensors) if self.objective.counts is not None else {}


def register_estimator(spec: EstimatorSpec) -> EstimatorSpec:
    """Register ``spec`` under ``spec.name`` (registry ``adv_estimator``); the same spec again is a no-op,
    another under a taken name is a ValueError."""
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(f"register_estimator takes an EstimatorSpec, got {type(spec).__name__}")
    as_classes(spec.options, f"adv_estimator {spec.name!r}")
    ADV_ESTIMATORS.register(spec.name, spec)
    return spec


def estimator(name: str, options: Any = None, inputs: Optional[InputsFn] = None,
              **needs: Need) -> Callable[[Callable], Callable]:
    """Decorator: register the decorated function as estimator ``name`` with its ``options`` classes, its batch
    ``inputs`` and ``needs`` (EstimatorSpec fields); returns the function unchanged."""

    def add(fn: Callable) -> Callable:
        register_estimator(EstimatorSpec(name, fn, options=options, inputs=inputs, **needs))
        return fn

    return add


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Register ``spec`` under ``spec.name`` (registry ``objective``), as :func:`register_estimator`."""
    if not isinstance(spec, ObjectiveSpec):
        raise TypeError(f"register_objective takes an ObjectiveSpec, got {type(spec).__name__}")
    as_classes(spec.options, f"objective {spec.name!r}")
    OBJECTIVES.register(spec.name, spec)
    return spec


def estimator_spec(name: str) -> EstimatorSpec:
    """The record of estimator ``name``; unknown names raise UnknownNameError listing the registered ones."""
    return ADV_ESTIMATORS.get(str(name))


def objective_spec(name: str) -> ObjectiveSpec:
    """The record of objective ``name``; unknown names raise UnknownNameError listing the registered ones."""
    return OBJECTIVES.get(str(name))


def _need(value: Need, algorithm: Any) -> bool:
    return bool(value(algorithm) if callable(value) else value)


def algorithm_spec(algorithm: Any) -> AlgorithmSpec:
    """Resolve the ``algorithm`` config section (``objective``, ``adv_estimator`` and the options the needs
    read) to its :class:`AlgorithmSpec`. The estimator counts only for an objective that uses it."""
    objective = objective_spec(algorithm.objective)
    est = estimator_spec(algorithm.adv_estimator) if objective.uses_estimator else None
    parts = (objective,) if est is None else (objective, est)

    def need(field: str) -> bool:
        return any(_need(getattr(p, field), algorithm) for p in parts)

    kl_in_reward = bool(algorithm.use_kl_in_reward)
    return AlgorithmSpec(
        objective=objective, estimator=est, needs_critic=need("needs_critic"),
        needs_reference=need("needs_reference") or kl_in_reward,
        needs_old_log_probs=need("needs_old_log_probs") or kl_in_reward, per_token_rewards=need("per_token_rewards"),
        needs_groups=need("needs_groups"), needs_greedy_baseline=need("needs_greedy_baseline"),
        needs_pairs=_need(objective.needs_pairs, algorithm), needs_sum_pi_squared=need("needs_sum_pi_squared"),
        needs_implicit_rewards=need("needs_implicit_rewards"))


class _Switch(Protocol):
    @property
    def enable(self) -> Optional[bool]: ...


class _KLLoss(Protocol):
    @property
    def use_kl_loss(self) -> bool: ...


class _Run(Protocol):
    """What the role switches below read of a run config (portrl.config.schema.PortRLConfig is one; algo/ sits
    below the config, so it names no schema class): the ``algorithm`` section, read by :func:`algorithm_spec`."""

    @property
    def algorithm(self) -> Any: ...


class _CriticRun(_Run, Protocol):
    @property
    def critic(self) -> _Switch: ...


class _PrmRun(_Run, Protocol):
    @property
    def reward_model(self) -> _Switch: ...


class _RefRun(_Run, Protocol):
    @property
    def ref(self) -> _Switch: ...

    @property
    def actor(self) -> _KLLoss: ...


def critic_enabled(cfg: _CriticRun) -> bool:
    """The critic runs when ``critic.enable`` says so, or (auto, null) when the algorithm needs values."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return algorithm_spec(cfg.algorithm).needs_critic


def implicit_prm_enabled(cfg: _PrmRun) -> bool:
    """PRIME's implicit process reward model runs when ``reward_model.enable`` says so, or (auto, null) when the
    algorithm reads implicit rewards."""
    if cfg.reward_model.enable is not None:
        return bool(cfg.reward_model.enable)
    return algorithm_spec(cfg.algorithm).needs_implicit_rewards


def reference_enabled(cfg: _RefRun) -> bool:
    """The reference runs when ``ref.enable`` says so, or (auto, null) when the KL loss
    (``actor.use_kl_loss``) or the algorithm (KL in the reward, DPO) needs it."""
    if cfg.ref.enable is not None:
        return bool(cfg.ref.enable)
    return bool(cfg.actor.use_kl_loss) or algorithm_spec(cfg.algorithm).needs_reference
