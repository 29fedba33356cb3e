"""Ascend version facts: the torch / torch_npu / CANN rows, the vllm-ascend rows, and how to read them here.

Rows from the release notes of torch_npu and vllm-ascend. The installed
CANN version is read from the toolkit's install record
``<toolkit home>/<arch>-linux/ascend_toolkit_install.info`` (line ``version=...``), the path
CANN's installation guide documents; nothing is imported or executed.
"""

from __future__ import annotations

import glob
import os

from packaging.version import InvalidVersion, Version

from portrl.device.versions import CompatRow

#: variables that CANN's set_env.sh exports; one of them set means the toolkit environment is loaded
CANN_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"

_TORCH_NPU_ROWS = (  # torch_npu, torch, CANN
    ("2.10.0.post4", "2.10.0", "9.1.0"),
    ("2.10.0", "2.10.0", "9.0.0"),
    ("2.9.0", "2.9.0", "8.5.0"),
    ("2.8.0.post2", "2.8.0", "8.5.0"),
    ("2.7.1", "2.7.1", "8.3.RC1"),
    ("2.6.0", "2.6.0", "8.2.RC1"),
    ("2.5.1", "2.5.1", "8.1.RC1"),
)
_VLLM_ASCEND_ROWS: tuple[tuple[str, str, str, str, dict[str, str]], ...] = (  # vllm-ascend (= vllm tag), CANN, torch, torch_npu, extra pins
    ("0.23.0", "9.1.0", "2.10.0", "2.10.0.post4", {"triton-ascend": "3.2.2"}),
    ("0.13.0", "8.5.0", "2.8.0", "2.8.0", {}),
    ("0.11.0", "8.3.RC2", "2.7.1", "2.7.1.post1", {}),
)



def install_line(torch: str, cann: str, *packages: str) -> str:
    """The row's install command: torch's CPU wheel (torch_npu adds the device), the pip packages, and CANN, which
    is a system toolkit (Huawei's installer), not a pip package."""
    pins = " ".join(f'"{p}"' for p in packages)
    return (f'pip install "torch=={torch}" --index-url https://download.pytorch.org/whl/cpu && pip install {pins}; '
            f"CANN {cann} from Huawei's toolkit installer, then {CANN_SET_ENV}")


COMPAT_ROWS: tuple[CompatRow, ...] = (
    *(CompatRow({"vllm-ascend": va, "vllm": va, "CANN": cann, "torch": torch, "torch-npu": npu, **extra},
                f"vllm-ascend v{va} release",
                install_line(torch, cann, f"torch-npu=={npu}", f"vllm=={va}", f"vllm-ascend=={va}",
                             *(f"{k}=={v}" for k, v in extra.items())))
      for va, cann, torch, npu, extra in _VLLM_ASCEND_ROWS),
    *(CompatRow({"torch-npu": npu, "torch": torch, "CANN": cann}, f"torch_npu {npu} release",
                install_line(torch, cann, f"torch-npu=={npu}"))
      for npu, torch, cann in _TORCH_NPU_ROWS),
)

#: the row the ``npu`` extra of pyproject.toml installs
NPU_EXTRA_ROW = COMPAT_ROWS[0]


def cann_home() -> str | None:
    """The CANN toolkit directory from the environment set_env.sh leaves, or None when not sourced."""
    return next((os.environ[v] for v in CANN_HOME_VARS if os.environ.get(v)), None)


def cann_version(home: str | None = None) -> str | None:
    """The installed CANN version (e.g. ``"9.1.0"``, ``"8.3.RC1"``) from the toolkit install record, or None."""
    home = home or cann_home()
    if not home:
        return None
    for path in sorted(glob.glob(os.path.join(home, "*-linux", "ascend_toolkit_install.info"))):
        try:
            with open(path) as fh:
                for line in fh:
                    key, _, value = line.strip().partition("=")
                    if key == "version" and value:
                        return value.strip()
        except OSError:
            continue
    return None


def torch_pair_mismatch(torch_version: str, torch_npu_version: str) -> str:
    """Why this torch_npu cannot run with this torch, or "" when they pair.

    torch_npu X.Y.Z[.postN] is built for torch X.Y.Z exactly (every row above); local tags
    (``+cpu``) are ignored.
    """
    try:
        want = Version(torch_npu_version).release[:3]
        have = Version(torch_version).release[:3]
    except InvalidVersion:
        return f"cannot parse versions torch {torch_version!r} / torch_npu {torch_npu_version!r}"
    if want == have:
        return ""
    need = ".".join(map(str, want))
    return (f"torch_npu {torch_npu_version} is built for torch {need} but torch {torch_version} is installed; "
            f"pip install torch=={need} (or the torch_npu release for your torch)")
