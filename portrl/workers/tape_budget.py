"""How many bytes the rollout's recorded forward (portrl/models/forward_tape.py) may hold under gradient checkpointing.

Checkpointing exists to bound memory, so the update replays the rollout's recording only while it is small:

    budget = min(TAPE_PARAM_MULTIPLE x param_bytes, TAPE_FREE_FRACTION x max(0, free - pending))

``free``: the device's free memory now (``Backend.memory_available``; None: only the first bound); ``pending``:
what the update will still allocate, the trainable parameters' gradients and, while the optimizer holds no state,
AdamW's two moments (``3 x trainable bytes``, else ``1 x``; ``portrl.workers.training.build_optimizer`` allocates
them with the optimizer). A rollout over the budget is not recorded and the
update recomputes its forward.
"""

from __future__ import annotations

from typing import Optional

#: a recorded forward may hold up to this many times the policy's parameter bytes (Qwen2.5-0.5B, 4 prompts x
#: 4 samples x 128 new tokens: a 3.2 GB tape against 2.0 GB of weights)
TAPE_PARAM_MULTIPLE = 2
#: ... and up to this fraction of the device's free memory at the rollout less what the update will allocate (at
#: that size a 16 GB host recomputes; a 24 GB one replays, its step peaking at 15.2 GiB with the cpu preset)
TAPE_FREE_FRACTION = 0.5


def tape_budget(param_bytes: int, trainable_bytes: int, optimizer_started: bool, free: Optional[int]) -> int:
    """The formula of the module docstring, in bytes."""
    budget = TAPE_PARAM_MULTIPLE * param_bytes
    if free is None:
        return int(budget)
    pending = trainable_bytes * (1 if optimizer_started else 3)
    return int(min(budget, TAPE_FREE_FRACTION * max(0, free - pending)))
