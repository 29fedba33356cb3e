"""The RolloutEngine contract every engine implements (the ``hf`` engine here; others in ``backends/``).

Required: :meth:`RolloutEngine.generate` turns prompt token ids into sampled responses with per-token
log-probs (:mod:`portrl.rollout.types` states the log-prob convention) and
:meth:`RolloutEngine.update_weights` takes the trainer's weights after every update.

Optional capabilities, declared in the class attribute ``capabilities`` (an :class:`EngineCapabilities`) and
queried by the workers through the methods below, never through an engine's own attributes. An engine that
declares none still works: it gets its weights by ``update_weights``, is never asked to record, and is never
put to sleep.

* ``in_process_weights``: built with ``model=`` (the trainer's module), the engine decodes that module itself,
  so a weight sync moves nothing (:meth:`RolloutEngine.shares_module`);
* ``forward_recording``: a rollout can leave a :class:`portrl.models.forward_tape.ForwardTape` the trainer's
  forward on the same weights replays (:meth:`RolloutEngine.can_record_forward`,
  :meth:`RolloutEngine.start_recording`, :meth:`RolloutEngine.stop_recording`);
* ``sleep_wake``: :meth:`RolloutEngine.sleep` frees memory between rollouts, :meth:`RolloutEngine.wake` undoes it;
* ``interruptible``: after :meth:`RolloutEngine.set_interrupt` with a ``threading.Event``, a ``generate`` running
  while the event is set ends early; rows not finished return their tokens and log-probs so far with finish reason
  ``abort`` (partial rollout of the asynchronous modes: the rollout worker loads new weights and continues them).

Constructor options: the engine class translates the engine-neutral
:class:`portrl.rollout.settings.RolloutSettings` into its own keywords (:meth:`RolloutEngine.translate_settings`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import torch

from portrl.device.backend import Backend
from portrl.rollout.settings import RolloutSettings
from portrl.rollout.types import RolloutOutput, SamplingParams


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine class can do beyond generate / update_weights (default: nothing optional)."""

    in_process_weights: bool = False  # built with model=, it decodes that module itself (no weight sync)
    forward_recording: bool = False  # a rollout can be recorded for the trainer's replay
    sleep_wake: bool = False  # sleep() frees memory between rollouts
    interruptible: bool = False  # set_interrupt(event): a set event ends generate early (finish reason abort)


# the methods an engine must override for each capability it declares (checked when the class is defined)
_CAPABILITY_METHODS = {
    "in_process_weights": ("shares_module",),
    "forward_recording": ("can_record_forward", "start_recording", "stop_recording"),
    "sleep_wake": ("sleep", "wake"),
    "interruptible": ("set_interrupt",),
}


class RolloutEngine(abc.ABC):
    """Base class of rollout engines.

    Subclasses are built by :func:`portrl.rollout.make_engine` with the keywords
    ``model``, ``model_path``, ``tokenizer``, ``backend`` plus their own options.
    """

    #: registry name ("hf", ...); set by subclasses
    name: str = ""
    #: the optional capabilities this class implements (see the module docstring)
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        caps = cls.capabilities
        if not isinstance(caps, EngineCapabilities):
            raise TypeError(f"{cls.__qualname__}.capabilities must be an EngineCapabilities, got {caps!r}")
        for flag, methods in _CAPABILITY_METHODS.items():
            missing = [m for m in methods if getattr(caps, flag) and getattr(cls, m) is getattr(RolloutEngine, m)]
            if missing:
                raise TypeError(f"{cls.__qualname__} declares {flag} but does not implement {', '.join(missing)}")

    @classmethod
    def translate_settings(cls, settings: RolloutSettings) -> dict[str, Any]:
        """This engine's constructor options for the run's :class:`RolloutSettings` (default: none; the engine
        keeps its own defaults). The backend adjusts the result before the engine is built."""
        return {}

    @classmethod
    def runs_on(cls, backend: Backend) -> bool:
        """Whether this engine runs on ``backend`` although the backend does not list it in its
        ``rollout_engines()`` (a third-party engine says so here instead of changing the backends; the built-in
        engines are listed by the backends and keep the default, False)."""
        return False

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 multi_modal: Sequence[dict | None] | None = None) -> RolloutOutput:
        """Sample ``params.n`` responses for every prompt (token ids, unpadded).

        Rows come back prompt-major: row ``i * n + j`` is sample ``j`` of prompt ``i``.
        ``multi_modal`` (engines of vision-language models): one entry per prompt, None for a text prompt, else
        the data layer's dict ``{"images": [PIL images], "raw_prompt_ids": [ids with one image pad per image],
        "inputs": {"pixel_values", "image_grid_thw"}}`` (``PromptBatch.multi_modal``, portrl/data/); then
        ``prompts[i]`` holds the expanded ids. Callers pass it only when some prompt has images, so an engine
        for text models may leave the parameter out.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights (HF parameter names) into the engine; later ``generate`` calls use them."""

    # --- optional capabilities (defaults: not supported) -----------------------------------------
    def shares_module(self, module: torch.nn.Module) -> bool:
        """True when ``generate`` decodes ``module`` itself (in this process), so that ``update_weights`` with
        its weights would move nothing."""
        return False

    def can_record_forward(self) -> bool:
        """True when the next ``generate`` calls can be recorded (:meth:`start_recording`)."""
        return False

    def start_recording(self, max_bytes: int | None = None) -> None:
        """Record the forward of the following ``generate`` calls (only where :meth:`can_record_forward`); a call
        whose recording would hold more than ``max_bytes`` (None: no limit) is not recorded."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} engine cannot record its forward")

    def stop_recording(self) -> Any:
        """Stop recording and return the last ``generate`` call's ForwardTape (None when it left none)."""
        return None

    def set_interrupt(self, event: Any) -> None:
        """Watch ``event`` (a ``threading.Event``; None: stop watching): while it is set, ``generate`` ends early and
        returns the rows not yet finished with finish reason ``abort`` (only where the class is ``interruptible``)."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} engine cannot be interrupted")

    def sleep(self) -> None:
        """Free the memory the engine holds between rollouts, where it can (default: nothing to free)."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next ``generate``."""


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS id(s) (``eos_token_id``: an int, a list, or None), which every engine adds to its stop ids."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate prompts (a non-empty list of non-empty token-id lists) and return them as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")
        ids = [int(t) for t in p]
        if min(ids) < 0:
            raise ValueError(f"prompt {i} has a negative token id (left padding must be removed): {ids[:8]}...")
        out.append(ids)
    return out
