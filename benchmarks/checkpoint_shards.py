"""Checkpoint write time and bytes per rank under FSDP2: every rank writing its own shard against rank 0's gather.

    python benchmarks/checkpoint_shards.py [--workers 2] [--hidden 512] [--layers 8] [--repeat 3]

A random model of the tiny architecture at the given size trains one update on ``--workers`` Ray workers
(FSDP2 over gloo on the CPU, float32, AdamW), then its actor state (model and optimizer) is written both ways
into a temporary folder, ``--repeat`` times each, best time kept:

* gather: ``rank0("state_dict")`` (every rank all-gathers every tensor, rank 0's full state goes to the driver)
  and ``save_state`` there: one ``actor.safetensors`` (what portrl wrote before sharding, and still writes for
  one worker);
* shards: ``run("save_shard")``: each rank writes ``actor/rank_<r>.safetensors`` of its own rows, nothing
  gathered (portrl/state_files.py).

Prints the seconds and the bytes each rank (and the driver) writes, and checks that the shards joined equal the
gathered state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.state_files import ShardedState, save_state  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402
from portrl.workers.batch import build_rollout_batch  # noqa: E402
from portrl.workers.group import WorkerGroup  # noqa: E402
from portrl.workers.ray_env import init_ray  # noqa: E402


def _cfg(path: str):
    cfg = default_config()
    for k, v in {"device.name": "cpu", "device.num_threads": 1, "model.path": path, "rollout.n": 4,
                 "data.max_response_length": 6, "actor.ppo_mini_batch_size": 4, "actor.ppo_epochs": 1}.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    import ray

    from portrl.models import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=8, num_kv_heads=2, intermediate_size=4 * args.hidden, seed=0)
        cfg = _cfg(str(model))
        init_ray(cfg, get_backend("cpu"), num_cpus=max(2, args.workers))
        group = WorkerGroup(ActorRolloutWorker, cfg, args.workers, get_backend("cpu"), role="actor")
        try:
            g = torch.Generator().manual_seed(0)
            batch = build_rollout_batch([[5, 6, 7]] * 4, [[8, 9, 10, 11]] * 16, n=4)
            batch["advantages"] = torch.randn(len(batch), 1, generator=g) * batch["response_mask"]
            group.metrics("update_actor", batch)  # the optimizer holds its moments
            params = sum(v.numel() for v in group.full_weights().values())
            gather_dir, shard_dir = Path(tmp) / "gather", Path(tmp) / "shards"

            def gather():
                shutil.rmtree(gather_dir, ignore_errors=True)
                gather_dir.mkdir()
                state = group.rank0("state_dict")
                state.pop("ref", None)
                save_state(gather_dir, "actor", state)

            def shards():
                shutil.rmtree(shard_dir, ignore_errors=True)
                shard_dir.mkdir()
                group.run("save_shard", str(shard_dir), "actor")

            t_gather, t_shards = _best(gather, args.repeat), _best(shards, args.repeat)
            whole = ShardedState(shard_dir, "actor").load()
            full = group.rank0("state_dict")
            assert all(torch.equal(whole["model"][k], v) for k, v in full["model"].items())
            one = (gather_dir / "actor.safetensors").stat().st_size
            per_rank = [(shard_dir / "actor" / f"rank_{r}.safetensors").stat().st_size for r in range(args.workers)]
        finally:
            group.shutdown()
            ray.shutdown()
    print(f"\nactor state of a {params / 1e6:.1f}M-parameter model (hidden {args.hidden}, {args.layers} layers, "
          f"float32, AdamW), {args.workers} FSDP2 workers on the CPU, best of {args.repeat}")
    print(f"{'':<8} {'seconds':>8}  bytes written")
    print(f"{'gather':<8} {t_gather:>8.2f}  {one / 2**20:.1f} MiB by the driver (rank 0's full state)")
    sizes = ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(per_rank))
    print(f"{'shards':<8} {t_shards:>8.2f}  {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
