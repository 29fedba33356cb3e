"""A weight sync from a training mesh (issue 60, item 6): two trainer ranks hold a tiny Qwen2 under tensor parallel 2
(every parameter a DTensor sharded over ``tp``); trainer rank 0 sends through each CPU transport in ``bucketed``
mode to a receiver process, the other trainer rank joins the gathers. The receiver ends with the unsharded
model's tensors bitwise, and the sender, given the tensors' metadata first
(:func:`portrl.workers.lora.merged_weight_meta`), gathers bucket by bucket: its measured peak stays within a few
buckets while gathering the whole model first (no metadata) holds all of it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.device import get_backend  # noqa: E402
from portrl.device.weight_transport import bucket_cap  # noqa: E402
from portrl.workers.parallel import find_free_port  # noqa: E402

ADDR = "127.0.0.1"
BUCKET_MB = 16 / 1024  # 16 KiB: the tiny model's sync takes dozens of buckets
SLACK = 16 * 1024  # the gathers' own small tensors and the pickled header


def _trainer(rank: int, model_dir: str, ports: dict, out: Path) -> None:
    from portrl.device.mesh_shape import MeshShape
    from portrl.device.weight_transport import make_sender, transport_spec
    from portrl.models import load_causal_lm
    from portrl.workers.lora import merged_weight_meta, merged_weights
    from portrl.workers.mesh import build_mesh
    from portrl.workers.parallel import init_distributed, wrap_model

    backend = get_backend("cpu")
    backend.configure_allocator()  # counts tensor bytes: memory_stats' peak_allocated
    init_distributed(backend, rank, 2, ADDR, ports["mesh"], timeout_s=120)
    model = load_causal_lm(model_dir, "float32", backend=backend)
    wrap_model(model, "fsdp", backend, device=torch.device("cpu"), mesh=build_mesh("cpu", MeshShape.of(2, tp=2), rank))
    assert all(hasattr(p, "placements") for p in model.parameters())  # sharded: a gather per tensor
    peaks = {}
    for transport, port in ports["sync"].items():
        sender = make_sender(transport_spec(transport), backend, ADDR, port, 2, BUCKET_MB, "bucketed",
                             timeout_s=120) if rank == 0 else None
        for version, meta in ((1, merged_weight_meta(model)), (2, None)):
            backend.reset_peak_memory()
            base = backend.memory_stats()["allocated"]
            if sender is None:
                for _ in merged_weights(model):
                    pass
            else:
                sender.send(merged_weights(model), version, meta=meta)
            peaks[transport, version] = backend.memory_stats()["peak_allocated"] - base
        if sender is not None:
            sender.close()
    if rank == 0:
        torch.save(peaks, out / "peaks.pt")


def _receiver(model_dir: str, ports: dict, out: Path) -> None:
    from portrl.device.weight_transport import make_receiver, transport_spec

    backend = get_backend("cpu")
    got = {}
    for transport, port in ports["sync"].items():
        receiver = make_receiver(transport_spec(transport), backend, ADDR, port, 1, 2, timeout_s=120)
        for version in (1, 2):
            got[transport, version] = {n: t.clone() for n, t in receiver.receive()}
            assert receiver.last_version == version
            got[transport, version, "stats"] = receiver.last_stats
        receiver.close()
    torch.save(got, out / "received.pt")


def _member(rank: int, model_dir: str, ports: dict, out: str) -> None:
    torch.set_num_threads(1)
    try:
        if rank < 2:
            _trainer(rank, model_dir, ports, Path(out))
        else:
            _receiver(model_dir, ports, Path(out))
    except BaseException as exc:
        (Path(out) / f"member{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        raise


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    from portrl.models import write_tiny_model

    work = tmp_path_factory.mktemp("mesh_sync")
    model_dir = write_tiny_model(work / "tiny", hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                                 initializer_range=0.2, seed=3)
    ports = {"mesh": find_free_port(ADDR),
             "sync": {t: find_free_port(ADDR) for t in get_backend("cpu").weight_transports}}
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, str(model_dir), ports, str(work)), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    errors = sorted(work.glob("member*.error"))
    assert not errors, errors[0].read_text()
    return model_dir, torch.load(work / "received.pt", weights_only=False), torch.load(work / "peaks.pt")


def test_the_receiver_holds_the_unsharded_model_bitwise(synced):
    from portrl.models import load_causal_lm

    model_dir, received, _ = synced
    want = load_causal_lm(model_dir, "float32", backend="cpu").state_dict()
    for key, state in received.items():
        if len(key) == 3:
            continue
        assert list(state) == list(want), key
        for name, t in state.items():
            assert t.dtype == want[name].dtype and torch.equal(t, want[name]), (key, name)


def test_the_sender_gathers_bucket_by_bucket_when_the_metadata_comes_first(synced):
    from portrl.models import load_causal_lm

    model_dir, received, peaks = synced
    state = load_causal_lm(model_dir, "float32", backend="cpu").state_dict()
    meta = [(n, tuple(t.shape), "float32") for n, t in state.items()]
    cap = bucket_cap(meta, int(BUCKET_MB * 2**20))
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total > 6 * cap  # so that holding the whole model and holding a few buckets differ
    for transport in get_backend("cpu").weight_transports:
        stats = received[transport, 1, "stats"]
        assert stats.buckets > 10 and stats.buffer_bytes <= cap
        streamed, gathered_first = peaks[transport, 1], peaks[transport, 2]
        # a bucket of gathered tensors, the transport's buffer, one gather's temporaries
        assert streamed <= 3 * cap + SLACK, (transport, streamed, cap)
        assert gathered_first >= total, (transport, gathered_first, total)
