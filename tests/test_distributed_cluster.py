"""Scale-out: a simulated two-node Ray cluster on this machine (ray.cluster_utils.Cluster). The trainer joins
it through ``trainer.ray_address``; a resource pool larger than one node spans both, and the two workers
form one gloo process group across the nodes."""

import os
import sys

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
ray = pytest.importorskip("ray")

from portrl.config.options_schema import default_config  # noqa: E402
from portrl.device import get_backend  # noqa: E402
from portrl.workers.batch import Batch  # noqa: E402
from portrl.workers.group import WorkerGroup  # noqa: E402
from portrl.workers.ray_env import ResourcePool, init_ray  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SumWorker:
    """All-reduces the sum of its piece of the batch over the group."""

    def __init__(self, cfg, rank=0, world_size=1):
        self.rank = rank

    def total(self, batch):
        import torch.distributed as dist

        t = batch["x"].sum().double()
        dist.all_reduce(t)
        return {"total": float(t), "rows": [len(batch)], "rank": [self.rank]}


def node_bundles(pool: ResourcePool) -> list:
    """Node id of each bundle (in rank order), from Ray's placement-group table."""
    table = ray.util.placement_group_table(pool.create())
    by_index = table.get("bundles_to_node_id", {})
    return [by_index.get(i, "") for i in range(pool.num_workers)]


def test_pool_spans_two_nodes_of_a_joined_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        cluster.wait_for_nodes()
        cfg = default_config()
        cfg.trainer.ray_address = cluster.address
        backend = get_backend("cpu")
        init_ray(cfg, backend)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        pool = ResourcePool("actor", 2, backend, cpus_per_worker=1)  # PACK: one node holds one bundle only
        group = WorkerGroup(SumWorker, cfg, 2, backend, role="actor", pool=pool)  # Ray: a cluster is named
        assert len(set(node_bundles(pool))) == 2
        assert len({i["node_id"] for i in group.info}) == 2  # one worker on each node
        x = torch.arange(10.0).view(10, 1)
        out = group.metrics("total", Batch({"x": x}))
        assert out["total"] == float(x.sum()) and out["rows"] == [5, 5] and out["rank"] == [0, 1]
        assert "on node" in group.describe(1) and group.info[1]["node_id"][:8] in group.describe(1)
        group.shutdown()
        pool.remove()
    finally:
        ray.shutdown()
        cluster.shutdown()
