"""The npu backend's peak table (portrl/device/peaks.py). The device presets' models are declared so that
``device.model`` names them, with no peaks: Huawei publishes no dense bf16 figure and HBM bandwidth for the Atlas
A2 (910B) and A3 (910C) NPUs that portrl can cite (the figure verl uses, 354 TFLOPS, has no datasheet behind it),
so a run on them reports "no peak figure" rather than a guess. torch_npu names the chips "Ascend910B<n>" (A2)."""

from __future__ import annotations

from portrl.device.peaks import DeviceModel

DEVICE_MODELS: tuple[DeviceModel, ...] = (
    DeviceModel("ascend-910b", ("910b",)),
    DeviceModel("ascend-910c", ("910c",)),
)
