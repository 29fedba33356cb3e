"""A rollout batch of random tokens with random advantages: what the tests that compare two ways of running the
same update feed both sides (tests/test_distributed_real_worker.py, tests/test_offload.py)."""

from __future__ import annotations

import torch

from portrl.workers.batch import Batch, build_rollout_batch


def random_rollout_batch(seed: int, n_prompts: int = 4, n: int = 4) -> Batch:
    """``n_prompts`` prompts of 2-5 tokens, ``n`` responses of 1-6 tokens each (ids 3-29), and one advantage per
    row over its response tokens; the same for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 30, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    resp = [torch.randint(3, 30, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n_prompts * n)]
    b = build_rollout_batch(prompts, resp, n=n)
    b["advantages"] = torch.randn(len(b), 1, generator=g) * b["response_mask"]
    return b
