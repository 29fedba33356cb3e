"""The peak table (portrl/device/peaks.py): each backend's device models, matched from the runtime's device name or
named by ``device.model`` (each device preset names its own), with a source beside every figure; the cpu backend
measures its own peaks once per process."""

from __future__ import annotations

import pytest
import torch

from portrl.config import compose
from portrl.device.peaks import model_of_name
from portrl.device.registry import get_backend
from portrl.errors import UserError

PRESET_MODELS = {"a100": "cuda", "h100": "cuda", "h200": "cuda", "mi300x": "rocm", "mi325x": "rocm",
                 "ascend-910b": "npu", "ascend-910c": "npu"}


@pytest.mark.parametrize("preset", sorted(PRESET_MODELS))
def test_every_device_preset_names_a_model_of_its_backend(preset):
    cfg = compose(preset=preset)
    assert cfg.device.model == preset
    backend = get_backend(PRESET_MODELS[preset])
    assert preset in [m.name for m in backend.device_models]


def test_datasheet_figures_and_their_sources():
    cuda, rocm = get_backend("cuda"), get_backend("rocm")
    h100 = cuda.peak_throughput("bfloat16", "h100")
    assert (h100.flops_per_s, h100.bytes_per_s) == (989.4e12, 3.35e12) and "H100" in h100.source
    assert cuda.peak_throughput("float16", "h200").bytes_per_s == 4.8e12
    assert cuda.peak_throughput("bfloat16", "a100").flops_per_s == 312e12
    assert rocm.peak_throughput("bfloat16", "mi325x").bytes_per_s == 6.0e12
    assert cuda.peak_throughput("float32", "h100") is None  # no figure declared: none given
    for name in ("cuda", "rocm", "npu"):
        for model in get_backend(name).device_models:
            assert all(p.source and p.flops_per_s > 0 and p.bytes_per_s > 0 for p in model.peaks.values())
    npu = get_backend("npu")
    assert npu.peak_throughput("bfloat16", "ascend-910b") is None  # no published figure to cite


@pytest.mark.parametrize("device_name, model", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", None), ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", None), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", None),
    ("AMD Instinct MI300X", "mi300x"), ("AMD Instinct MI325X", "mi325x"), ("Ascend910B2", "ascend-910b"),
])
def test_the_model_is_detected_from_the_device_name(device_name, model):
    models = [m for b in ("cuda", "rocm", "npu") for m in get_backend(b).device_models]
    found = model_of_name(models, device_name)
    assert (found.name if found else None) == model


def test_an_unknown_model_is_one_line_listing_the_backends_models():
    with pytest.raises(UserError, match=r"device.model='h100' is not a device model of backend 'rocm'; "
                                        r"its models: mi300x, mi325x$"):
        get_backend("rocm").peak_throughput("bfloat16", "h100")
    with pytest.raises(UserError, match="its models: \\(none"):
        get_backend("cpu").peak_throughput("float32", "h100")


def test_the_cpu_measures_its_own_once_per_process():
    cpu = get_backend("cpu")
    peak = cpu.peak_throughput("float32")
    assert peak.flops_per_s > 1e8 and peak.bytes_per_s > 1e8 and peak.source.startswith("measured")
    assert cpu.peak_throughput("float32") is peak  # cached: no second measurement
    threads = torch.get_num_threads()
    try:  # measured again on other threads (a run's device.num_threads)
        torch.set_num_threads(1 if threads > 1 else 2)
        assert cpu.peak_throughput("float32") is not peak
    finally:
        torch.set_num_threads(threads)


def test_a_gpu_is_named_without_a_context_of_the_trainers_own(monkeypatch):
    """The cuda backend asks NVML first; without it, torch only where this process already initialised the device
    (a Ray run's trainer process holds none): here, with no GPU, there is no name and no peak."""
    cuda = get_backend("cuda")
    monkeypatch.setattr(type(cuda), "_device_name_without_init", lambda self: "NVIDIA H100 80GB HBM3")
    assert cuda.peak_throughput("bfloat16").flops_per_s == 989.4e12
    monkeypatch.setattr(type(cuda), "_device_name_without_init", lambda self: "")
    assert cuda.device_name() == "" and cuda.peak_throughput("bfloat16") is None


def test_a_cpu_without_native_bf16_reads_bf16_against_float32s_peak(monkeypatch):
    """Emulated bf16 matmuls run at a shape-dependent fraction of float32's rate: their measured figure is no
    ceiling (the device check's CPU leg read MFU 1.96 against it), so such a CPU's bf16 peak is float32's."""
    cpu = get_backend("cpu")
    monkeypatch.setattr(type(cpu), "supports_bf16", lambda self: False)
    peak = cpu.peak_throughput("bfloat16")
    assert peak.flops_per_s == cpu.peak_throughput("float32").flops_per_s
    assert peak.source.startswith("no native bfloat16 arithmetic, so float32's peak: measured")
    monkeypatch.setattr(type(cpu), "supports_bf16", lambda self: True)
    assert cpu.peak_throughput("bfloat16").source.startswith("measured") and "bfloat16" in cpu.peak_throughput(
        "bfloat16").source
