"""The cuda backend's peak table (portrl/device/peaks.py): dense bf16 / fp16 tensor-core FLOP/s (the datasheets'
"with sparsity" figures halved) and HBM bandwidth, for the device presets' models. Matched against
``torch.cuda.get_device_name()``: "NVIDIA H100 80GB HBM3" (SXM5; the PCIe and NVL cards have lower peaks and are
not matched), "NVIDIA H200" (SXM; not the NVL), "NVIDIA A100-SXM4-80GB". float32 has no figure here (it runs
on TF32 or the CUDA cores, whichever torch chose)."""

from __future__ import annotations

from portrl.device.peaks import DeviceModel, half_precision


DEVICE_MODELS: tuple[DeviceModel, ...] = (
    DeviceModel("h100", ("h100 80gb hbm3", "h100 sxm"), half_precision(
        989.4e12, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity, 3.35 TB/s")),
    DeviceModel("h200", ("h200",), half_precision(
        989.4e12, 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, 4.8 TB/s"),
        excludes=("nvl",)),
    DeviceModel("a100", ("a100-sxm4-80gb", "a100 sxm4 80gb"), half_precision(
        312e12, 2.039e12, "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOPS, 2,039 GB/s")),
)
