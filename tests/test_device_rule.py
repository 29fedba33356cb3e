"""The layering rule: nothing under portrl/ mentions a vendor library or a vendor name (DESIGN.md, "Rule")."""

import re
from pathlib import Path

import pytest

PORTRL = Path(__file__).resolve().parents[1] / "portrl"

# Attribute paths and module names, matched as written; vendor names as whole words, any case.
FORBIDDEN = [
    r"torch\.cuda", r"torch\.npu", r"torch\.version\.hip", r"\btorch_npu\b", r"\bflash_attn\b",
    r"\bvllm\b", r"\baiter\b",
    r"\bnvidia\b", r"\bamd\b", r"\bascend\b", r"\bhuawei\b", r"\brocm\b", r"\bcuda\b", r"\bnpu\b",
    # CPU vendors, their processors, instruction sets and math libraries: the CPU backend's knowledge
    # (backends/cpu/). Architecture names stay (x86_64, aarch64: the code sandbox's syscall tables are per
    # architecture), so do variables named after a library (MKL_NUM_THREADS: a word of its own).
    r"\bintel\b", r"\bxeon\b", r"\bepyc\b", r"\bryzen\b", r"\bzen\d*\b", r"\bzentorch\b", r"\bsapphire rapids\b",
    r"\bskylake\b", r"\bgraviton\b", r"\bavx", r"\bamx\b", r"\bamx_", r"\bsse\d", r"\bneon\b",
    r"\bmkl\b", r"\bmkldnn\b", r"\bonednn\b", r"\bdnnl\b", r"\bopenblas\b", r"\bipex\b",
    r"\bintel_extension_for_pytorch\b",
]
PATTERN = re.compile("|".join(FORBIDDEN), re.IGNORECASE)


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix in {".pyc", ".parquet"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in PATTERN.finditer(line):
                found.append(f"{path.relative_to(root.parent)}:{lineno}: {m.group(0)!r} in {line.strip()[:100]}")
    return found


def test_portrl_mentions_no_vendor():
    found = violations(PORTRL)
    assert not found, "vendor names belong in backends/ only:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "import torch_npu", "x = torch.cuda.device_count()", "# runs on ROCm", "Ascend 910B", "an NVIDIA GPU",
    "from vllm import LLM", "torch.version.hip", "use flash_attn", "AMD Instinct", "device='npu'", "aiter kernels",
    "on the Intel host", "an Intel(R) Xeon(R)", "a 2-core AMD EPYC", "on a Zen 4 VM", "zen3", "Sapphire Rapids",
    "an AVX-512 kernel", "AVX2 + FMA", "avx512_bf16", "amx_bf16", "AMX tiles", "sse4_2", "Arm NEON",
    "MKL's sgemm", "torch.backends.mkldnn", "oneDNN", "the dnnl library", "OpenBLAS", "import ipex",
    "import intel_extension_for_pytorch",
])
def test_rule_catches(tmp_path, line):
    (tmp_path / "portrl").mkdir()
    (tmp_path / "portrl" / "m.py").write_text(f"{line}\n")
    assert violations(tmp_path / "portrl")


@pytest.mark.parametrize("line", ["accuracy = 1.0", "cudagraph_like = 1", "ascending order", "sample amdahl",
                                  "artificial intelligence", "zenith", "MKL_NUM_THREADS=1", "x86_64 and aarch64",
                                  "mklink /d", "amxx", "essential"])
def test_rule_spares_words_that_contain_a_name(tmp_path, line):
    (tmp_path / "portrl").mkdir()
    (tmp_path / "portrl" / "m.py").write_text(f"{line}\n")
    assert not violations(tmp_path / "portrl")


#: a branch on a tensor's device type (``x.device.type == "cpu"``, ``x.is_cpu``)
DEVICE_BRANCH = re.compile(r"\bdevice\.type\b|\.is_cpu\b")


def device_branches(root: Path) -> list[str]:
    return [f"{path.relative_to(root.parent)}:{lineno}: {line.strip()[:100]}"
            for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if DEVICE_BRANCH.search(line)]


def test_rollout_decodes_alike_on_every_device():
    """What a device changes in decoding is its backend's decode kernel (portrl/device/decode_kernel.py: the KV
    cache's layout, the ops a step runs), not a branch on a tensor's device in portrl/rollout/."""
    found = device_branches(PORTRL / "rollout")
    assert not found, "portrl/rollout/ branches on a device; ask its backend instead:\n" + "\n".join(found)


@pytest.mark.parametrize("line, branches", [('if w.device.type == "cpu":', True), ("cpu = x.is_cpu", True),
                                            ("kernel = backend.decode_kernel()", False), ("dev = x.device", False)])
def test_the_device_branch_rule(tmp_path, line, branches):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "m.py").write_text(f"{line}\n")
    assert bool(device_branches(tmp_path / "rollout")) == branches
