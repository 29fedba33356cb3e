"""The CPU kernels' build takes its C++ standard from the installed torch, and a build that fails (no working
compiler, flags that do not fit torch's headers) is one warning line, after which the fallback computes the same
result (backends/cpu/native_build.py). Every build here goes to a temporary cache folder."""

import inspect
import logging
import re

import pytest
import torch
import torch.nn.functional as F

from portrl.backends.cpu import native_build
from portrl.backends.cpu.kernels import linear_prepacked_rows
from portrl.backends.cpu.swiglu import swiglu_fused


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """A process state where no library was loaded or refused yet, building into ``tmp_path``; yields the
    warnings native_build logs."""
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_failed", {})
    monkeypatch.setattr(native_build, "_held", {})
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(f"{record.levelname} {handler.format(record)}")
    native_build.log.addHandler(handler)  # on the module's logger itself: an earlier test may stop propagation
    level = native_build.log.level
    native_build.log.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        native_build.log.removeHandler(handler)
        native_build.log.setLevel(level)


def test_the_standard_is_the_one_torch_builds_its_extensions_with(monkeypatch):
    from torch.utils import cpp_extension

    wanted = max(int(v) for v in re.findall(r"-std=c\+\+(\d+)", inspect.getsource(cpp_extension)))
    assert native_build.cxx_standard() == f"c++{wanted}"
    assert f"-std=c++{wanted}" in native_build.flags() and "-std=c++17" not in native_build.FLAGS
    monkeypatch.setattr(native_build, "_cpp_extension_source",
                        lambda: "flags = ['-std=c++17']  # ['-std=c++23'] for newer compilers")
    assert native_build.cxx_standard() == "c++23"
    assert [f for f in native_build.flags() if f.startswith("-std=")] == ["-std=c++23"]
    monkeypatch.setattr(native_build, "_cpp_extension_source", lambda: None)
    assert native_build.cxx_standard() is None
    assert not any(f.startswith("-std=") for f in native_build.flags())  # the compiler's default, not a guess


def test_the_cache_key_follows_the_standard(monkeypatch, tmp_path):
    monkeypatch.setenv("PORTRL_KERNEL_CACHE", str(tmp_path))
    first = native_build.library_path("swiglu")
    monkeypatch.setattr(native_build, "cxx_standard", lambda: "c++99")
    assert native_build.library_path("swiglu") != first


def test_first_error_is_one_line_without_folders():
    dump = ("In file included from /x/torch/include/ATen/core/Tensor.h:3,\n"
            "/x/torch/include/c10/util/StringUtil.h:65:22: error: 'is_enum_v' is not a member of 'std'\n"
            "/x/torch/include/ATen/ATen.h:5:2: error: #error C++17 or later compatible compiler is required\n"
            "compilation terminated.\n")
    assert native_build.first_error(dump) == "ATen.h:5:2: error: #error C++17 or later compatible compiler is required"
    assert native_build.first_error(dump.replace("#error", "")).startswith("StringUtil.h:65:22: error: 'is_enum_v'")
    assert native_build.first_error("") == "no output"
    assert native_build.first_error("ld: cannot find -ltorch_cpu\n") == "ld: cannot find -ltorch_cpu"
    assert len(native_build.first_error("error: " + "x" * 1000)) == 300


def test_a_compiler_that_fails_is_one_line_and_the_fallbacks_compute_the_same(fresh_build, monkeypatch):
    """CXX names /bin/false (found, exits 1, prints nothing): each library warns once, in one line naming the
    reason and what serves instead; the decode linear and SwiGLU still equal torch's."""
    monkeypatch.setenv("CXX", "false")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 8, generator=g), torch.randn(4, 8, generator=g)
    gate, up = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    for _ in range(2):
        torch.testing.assert_close(linear_prepacked_rows(w, None, rows=4)(x), F.linear(x, w))
        torch.testing.assert_close(swiglu_fused(gate, up), F.silu(gate) * up)
    assert len(fresh_build) == 2 and all("\n" not in m for m in fresh_build)
    rows, swiglu = fresh_build  # one warning for the cause; the second library, failing alike, an info line
    assert rows.startswith("WARNING the native CPU kernels of backends/cpu/rows_linear.cpp are off (building "
                           "rows_linear.cpp failed (false -std=")
    assert "exit 1): no output); instead, the decode linear takes MKL's packed matmul" in rows
    assert swiglu == ("INFO the native CPU kernels of backends/cpu/swiglu.cpp are off (the same reason); instead, "
                      "SwiGLU takes torch's ops")
    assert list((native_build.cache_root()).iterdir()) == []  # no library, no temporary file


@pytest.mark.skipif(native_build.compiler() is None, reason="needs a C++ compiler")
def test_flags_that_do_not_fit_torchs_headers_are_one_line(fresh_build, monkeypatch):
    """The real compiler with a standard torch's headers do not accept (as -std=c++17 meets torch 2.14's): it stops
    at the first error (-Wfatal-errors, about a second) and the warning is that error in one line, not a dump."""
    monkeypatch.setattr(native_build, "cxx_standard", lambda: "c++11")
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 8, generator=g), torch.randn(2, 8, generator=g)
    torch.testing.assert_close(linear_prepacked_rows(w, None, rows=2)(x), F.linear(x, w))
    assert len(fresh_build) == 1 and "\n" not in fresh_build[0] and fresh_build[0].startswith("WARNING ")
    assert "-std=c++11, exit 1): " in fresh_build[0] and " error: " in fresh_build[0]
    assert fresh_build[0].endswith("; instead, the decode linear takes MKL's packed matmul")


def test_the_cache_key_covers_the_headers_a_source_includes(monkeypatch, tmp_path):
    (tmp_path / "k.cpp").write_text('#include "a.h"\n#include <vector>\n#include "missing.h"\nint k;\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\nint a;\n')
    (tmp_path / "b.h").write_text('#pragma once\n#include "a.h"\nint b;\n')  # included twice: read once
    text = native_build.source_text(tmp_path / "k.cpp")
    assert [text.count(s) for s in ("int k;", "int a;", "int b;")] == [1, 1, 1]
    monkeypatch.setattr(native_build, "SOURCE_DIR", tmp_path)
    before = native_build.library_path("k", "avx2")
    (tmp_path / "b.h").write_text('#pragma once\nint b = 2;\n')  # a header two levels down changes
    assert native_build.library_path("k", "avx2") != before
