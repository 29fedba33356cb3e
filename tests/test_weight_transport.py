"""Conformance of the weight transports (portrl/device/weight_transport.py): every transport a backend offers,
in every mode, between real processes (one sender, two receivers, spawned; one receiver drains from a
background thread, as a rollout worker's listener does).

Each backend runs one set of processes that performs, for each of its transports and each mode, two syncs: the starting
weights (version 1), then the same weights with two tensors changed (version 2). The tests then check what came
back: the receivers hold the sender's weights bitwise (several dtypes, bfloat16 among them, odd shapes, a 0-d
tensor, NaN and -0.0, a tensor bigger than a bucket), the versions arrived, ``full`` sends one buffer per dtype,
``bucketed`` stays under its memory cap (reported by the transport and measured by the device's tensor-byte
count), ``delta`` sends only the changed tensors and still ends equal. The second sync comes as a trainer's mesh
sends it: the tensors' metadata first, each tensor made as the sender takes it (bucket by bucket in ``bucketed``;
tests/test_weight_sync_mesh.py measures what that saves). Accelerator backends run through the
same tests where they are usable here (one device per member), else they are skipped with the reason.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.device import get_backend  # noqa: E402
from portrl.workers.parallel import find_free_port  # noqa: E402
from portrl.device.weight_transport import SYNC_MODES, bucket_cap, element_size, numel, plan_buckets  # noqa: E402

BACKENDS = ("cpu", "cuda", "rocm", "npu")
ADDR = "127.0.0.1"
WORLD = 3  # the sender and two receivers
BUCKET = 16 * 1024  # bytes: "embed" (257 x 33 float32 = 33,924 bytes) is bigger than a bucket
SLACK = 8 * 1024  # measured peaks: a sync's small tensors besides its buffers (the pickled header's)
CHANGED = ("layer.0.w", "odd")


def _weights() -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    odd = r(3, 5, 7)
    odd[0, 0, 0], odd[1, 1, 1] = float("nan"), -0.0
    return {"embed": r(257, 33), "layer.0.w": r(7, 13).bfloat16(), "layer.0.b": r(13).bfloat16(),
            "norm": r(5).half(), "odd": odd, "scale": torch.tensor(0.5), "ids": torch.arange(11),
            "mask": torch.rand(9, generator=g) > 0.5, "layer.1.w": r(31, 17).bfloat16(), "layer.1.b": r(17).bfloat16()}


def _changed(w: dict) -> dict:
    out = dict(w)
    out["layer.0.w"] = w["layer.0.w"] + 1
    out["odd"] = w["odd"] * 2
    return out


def _raw(w: dict) -> dict:
    return {k: (str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                .numpy().tobytes()) for k, t in w.items()}


def _meta(w: dict) -> list:
    return [(k, tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in w.items()]


def _nbytes(w: dict, names) -> int:
    return sum(numel(w[k].shape) * element_size(str(w[k].dtype).replace("torch.", "")) for k in names)


def _memory(backend) -> tuple:
    stats = backend.memory_stats()
    return stats.get("allocated"), stats.get("peak_allocated")


def _peak_since(backend, base) -> int | None:
    _, peak = _memory(backend)
    return None if peak is None or base is None else peak - base


def _send(backend, spec, port: int, mode: str, rank: int) -> dict:
    from portrl.device.weight_transport import make_sender

    sender = make_sender(spec, backend, ADDR, port, WORLD, BUCKET / 2**20, mode, timeout_s=120)
    device = backend.device(rank) if backend.device_type != "cpu" else torch.device("cpu")
    w0 = {k: v.to(device) for k, v in _weights().items()}
    first = sender.send(w0.items(), 1)
    w1 = _changed(w0)
    backend.reset_peak_memory()
    base, _ = _memory(backend)
    # the second sync as a trainer's mesh sends it: the metadata first, each tensor made as it is taken
    second = sender.send(((k, t.clone()) for k, t in w1.items()), 2, meta=_meta(w1))
    peak = _peak_since(backend, base)
    sender.close()
    return {"stats": [asdict(first), asdict(second)], "weights": _raw(w1), "peak": peak}


def _receive(backend, spec, port: int, rank: int) -> dict:
    from portrl.device.weight_transport import make_receiver

    receiver = make_receiver(spec, backend, ADDR, port, rank, WORLD, timeout_s=120)
    state: dict = {}
    syncs, peak, errors = [], None, []

    def drain():
        try:
            for name, t in receiver.receive():
                if name in state and state[name].shape == t.shape and state[name].dtype == t.dtype:
                    state[name].copy_(t)
                else:
                    state[name] = t.to("cpu", copy=True)
                del t  # the caller's part of "one bucket at a time" (weight_transport's bucketed mode)
                if rank == 2:  # a slow loader: the sender must wait for it before reusing a buffer
                    time.sleep(0.003)
        except BaseException as exc:  # re-raised by the main thread
            errors.append(exc)

    for i in range(2):
        if i == 1:
            backend.reset_peak_memory()
            base, _ = _memory(backend)
        if rank == 2:  # a listener thread, as a rollout worker's
            thread = threading.Thread(target=drain, name="weight-listener")
            thread.start()
            thread.join()
        else:
            drain()
        if errors:
            raise errors[0]
        syncs.append({"stats": asdict(receiver.last_stats), "version": receiver.last_version})
        if i == 1:
            peak = _peak_since(backend, base)
    receiver.close()
    return {"syncs": syncs, "weights": _raw(state), "peak": peak}


def _member(rank: int, backend_name: str, ports: dict, queue) -> None:
    """One process of the test: rank 0 sends, 1 and 2 receive, for each transport of the backend and each mode
    (a port each), one after the other."""
    from portrl.device.weight_transport import transport_spec

    try:
        backend = get_backend(backend_name)
        backend.configure_allocator()  # the CPU counts tensor bytes (memory_stats' allocated / peak_allocated)
        if backend.device_type != "cpu":
            backend.set_device(rank)
        out = {}
        for (transport, mode), port in ports.items():
            spec = transport_spec(transport)
            out[transport, mode] = (_send(backend, spec, port, mode, rank) if rank == 0
                                    else _receive(backend, spec, port, rank))
        queue.put((rank, out, None))
    except BaseException as exc:
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
        raise


def _run_members(backend_name: str) -> dict:
    """``{rank: {(transport, mode): result}}`` of one set of member processes for every transport of the backend."""
    backend = get_backend(backend_name)
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    ports = {(t, m): find_free_port(ADDR) for t in backend.weight_transports for m in SYNC_MODES}
    procs = [ctx.Process(target=_member, args=(r, backend_name, ports, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, out, error = queue.get(timeout=300)
            assert error is None, f"member {rank} of backend {backend_name} failed: {error}"
            results[rank] = out
        return results
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


_RUNS: dict = {}  # backend name -> _run_members' result: one set of processes per backend


@pytest.fixture(params=[pytest.param((b, t), id=f"{b}-{t}") for b in BACKENDS for t in get_backend(b).weight_transports])
def run(request) -> dict:
    """``{rank: {mode: result}}`` for the (backend, transport) of the param."""
    backend_name, transport = request.param
    backend = get_backend(backend_name)
    probe = backend.probe()
    if not probe.usable:
        pytest.skip(f"backend {backend_name} is not usable here: {probe.reason}")
    if backend.device_type != "cpu" and probe.device_count < WORLD:
        pytest.skip(f"backend {backend_name}: the test needs {WORLD} devices (one per member), "
                    f"this machine has {probe.device_count}")
    if backend_name not in _RUNS:
        _RUNS[backend_name] = _run_members(backend_name)
    return {rank: {mode: out[transport, mode] for mode in SYNC_MODES} for rank, out in _RUNS[backend_name].items()}


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_receivers_hold_the_senders_weights_bitwise(run, mode):
    want = run[0][mode]["weights"]
    assert set(want) == set(_weights())
    for rank in (1, 2):
        got = run[rank][mode]["weights"]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == want[name], f"receiver {rank}, {mode}: {name} differs"


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_the_version_and_mode_travel(run, mode):
    assert [(s["version"], s["mode"]) for s in run[0][mode]["stats"]] == [(1, mode), (2, mode)]
    for rank in (1, 2):
        syncs = run[rank][mode]["syncs"]
        assert [s["version"] for s in syncs] == [1, 2]
        assert [(s["stats"]["version"], s["stats"]["mode"]) for s in syncs] == [(1, mode), (2, mode)]


def test_full_sends_one_buffer_per_dtype(run):
    w = _weights()
    dtypes = {str(t.dtype) for t in w.values()}
    for stats in run[0]["full"]["stats"]:
        assert stats["buckets"] == len(dtypes) and stats["tensors"] == len(w)
        assert stats["bytes"] == _nbytes(w, w)
    float32 = [k for k, t in w.items() if t.dtype == torch.float32]
    assert run[0]["full"]["stats"][1]["buffer_bytes"] >= _nbytes(w, float32) > bucket_cap(_meta(w), BUCKET)


def test_bucketed_stays_under_its_memory_cap(run):
    w = _weights()
    cap = bucket_cap(_meta(w), BUCKET)
    assert cap == _nbytes(w, ["embed"])  # the tensor bigger than a bucket travels alone
    sender = run[0]["bucketed"]
    for stats in sender["stats"]:
        assert stats["bytes"] == _nbytes(w, w) and stats["tensors"] == len(w)
        assert stats["buckets"] == len(plan_buckets(_meta(w), BUCKET)) > len({t.dtype for t in w.values()})
        assert 0 < stats["buffer_bytes"] <= cap
    for rank in (1, 2):
        assert all(0 < s["stats"]["buffer_bytes"] <= cap for s in run[rank]["bucketed"]["syncs"])
    measured = [run[r]["bucketed"]["peak"] for r in range(WORLD)]
    if any(m is None for m in measured):
        pytest.skip("this backend does not count tensor bytes here (the CPU's count needs a C++ compiler)")
    assert all(0 < m <= cap + SLACK for m in measured[1:]), measured  # each receiver's buffers, measured
    # the sender's: its buffer (shared memory: the segment is no tensor) and the one bucket of tensors it took
    assert measured[0] <= 2 * cap + SLACK, measured


def test_delta_moves_only_what_changed_and_ends_equal_to_full(run):
    w = _weights()
    first, second = run[0]["delta"]["stats"]
    assert first["tensors"] == len(w) and first["bytes"] == _nbytes(w, w)  # the first sync is full
    assert second["tensors"] == len(CHANGED) and second["bytes"] == _nbytes(w, CHANGED) < first["bytes"]
    for rank in (1, 2):
        assert run[rank]["delta"]["syncs"][1]["stats"]["tensors"] == len(CHANGED)
        assert run[rank]["delta"]["weights"] == run[rank]["full"]["weights"]


# ------------------------------------------------------------------- choosing a transport, the config, the metrics
def test_the_backend_chooses_the_transport():
    from portrl.errors import UserError
    from portrl.device.weight_transport import choose_transport

    cpu, cuda = get_backend("cpu"), get_backend("cuda")
    assert choose_transport(cpu, "auto", same_node=True).name == cpu.weight_transports[0] == "shared_memory"
    assert choose_transport(cpu, "auto", same_node=False).name == "broadcast"  # shared memory is one node only
    assert choose_transport(cpu, "broadcast", same_node=True).name == "broadcast"
    assert choose_transport(cuda, "auto", same_node=True).name == "broadcast"  # over cuda's dist_backend (nccl)
    with pytest.raises(UserError, match="needs the trainer and the rollout workers on one node"):
        choose_transport(cpu, "shared_memory", same_node=False)
    with pytest.raises(UserError, match="'shared_memory' is not offered by backend 'cuda'; it offers: auto, broadcast"):
        choose_transport(cuda, "shared_memory", same_node=True)
    for name in BACKENDS:  # every backend offers transports that exist, the broadcast among them
        offered = get_backend(name).weight_transports
        assert "broadcast" in offered and all(choose_transport(get_backend(name), t, True).name == t for t in offered)


@pytest.mark.parametrize("overrides, phrase", [
    (["rollout.weight_sync_mode=fast"], "rollout.weight_sync_mode='fast' is not one of 'full', 'bucketed', 'delta'"),
    (["rollout.weight_transport=nccl"], "rollout.weight_transport='nccl' is not one of 'auto', 'broadcast'"),
    (["rollout.weight_transport=shared_memory", "device.name=cuda"],
     "rollout.weight_transport='shared_memory' is not offered by backend 'cuda'; it offers: auto, broadcast"),
])
def test_a_bad_mode_or_transport_is_one_line_exit_2(overrides, phrase, capsys):
    from portrl.cli import main

    assert main(["--log-level", "WARNING", "config", "show", *overrides]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and phrase in err[0] and err[0].startswith("portrl config: error: "), err


def test_sync_stats_become_step_metrics():
    from portrl.device.weight_transport import SyncStats, sync_metrics

    stats = asdict(SyncStats(tensors=10, buckets=3, bytes=4096, seconds=0.25, mode="delta", version=7))
    assert sync_metrics(stats) == {"perf/weight_sync_s": 0.25, "perf/weight_sync_bytes": 4096.0,
                                   "perf/weight_sync_buckets": 3.0, "perf/weight_sync_tensors": 10.0}


def test_a_full_dev_shm_is_a_clear_error_not_a_sigbus(tmp_path, monkeypatch):
    import errno

    from portrl.workers import weight_shm

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = tmp_path / "segment"
    with pytest.raises(RuntimeError, match="cannot reserve a 64 MiB segment .* rollout.weight_transport=broadcast"):
        weight_shm._Mapping(str(path), 64 * 2**20, create=True)
    assert not path.exists()  # nothing left behind
