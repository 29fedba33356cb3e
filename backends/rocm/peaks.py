"""The rocm backend's peak table (portrl/device/peaks.py): dense bf16 / fp16 matrix FLOP/s and HBM bandwidth
for the device presets' models, matched against the device name torch reports ("AMD Instinct MI300X")."""

from __future__ import annotations

from portrl.device.peaks import DeviceModel, half_precision


DEVICE_MODELS: tuple[DeviceModel, ...] = (
    DeviceModel("mi300x", ("mi300x",), half_precision(
        1307.4e12, 5.3e12, "AMD Instinct MI300X data sheet: BF16 1307.4 TFLOPS dense, 5.3 TB/s")),
    DeviceModel("mi325x", ("mi325x",), half_precision(
        1307.4e12, 6.0e12, "AMD Instinct MI325X data sheet: BF16 1307.4 TFLOPS dense, 6 TB/s")),
)
