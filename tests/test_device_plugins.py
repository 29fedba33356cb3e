"""Entry-point plugins load one at a time: a broken third-party backend, rollout engine or algorithm plugin (an
import error, a wrong class) is recorded with its error, ``portrl devices`` lists it (``--json`` too), the others
still work,
and asking for it by name is one line naming the plugin and its error, exit code 2. The plugins are real
installed distributions (a dist-info directory with entry_points.txt) on sys.path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import portrl.algo.registry as algo_registry
import portrl.rollout.registry as engine_registry
from portrl.cli import main
from portrl.device import Backend, BackendError, backend_names, broken_backends, clear_cache, get_backend
from portrl.errors import UserError
from portrl.rollout import RolloutEngineError, broken_engines, choose_engine, engine_names

RAISES = "raise ImportError('libfoo.so: cannot open shared object file')\n"
NOT_A_CLASS = "class Nothing:\n    pass\n"


def write_plugin(root: Path, dist: str, groups: dict[str, list[tuple[str, str]]], modules: dict[str, str]) -> None:
    """An installed distribution ``dist`` declaring ``groups`` (group -> [(name, "module:attr")]) plus its modules."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    text = "".join(f"[{g}]\n" + "".join(f"{n} = {v}\n" for n, v in eps) for g, eps in groups.items())
    (info / "entry_points.txt").write_text(text)
    for module, body in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(body))


PLUGINS = {
    "portrl.backends": [("xpu", "portrl_test_xpu_broken:XPUBackend"), ("wrong", "portrl_test_wrong:Nothing")],
    "portrl.rollout_engines": [("turbo", "portrl_test_turbo_broken:TurboEngine"),
                               ("odd", "portrl_test_wrong:Nothing")],
    "portrl.algorithms": [("fancy", "portrl_test_fancy_algo")],
}
MODULES = {"portrl_test_xpu_broken": RAISES, "portrl_test_turbo_broken": RAISES, "portrl_test_wrong": NOT_A_CLASS,
           "portrl_test_fancy_algo": "raise ModuleNotFoundError(\"No module named 'fancy_math'\")\n"}


def reset_plugins() -> None:
    clear_cache()
    engine_registry.PLUGINS.reset()
    algo_registry.PLUGINS.reset()


@pytest.fixture
def broken(tmp_path, monkeypatch):
    write_plugin(tmp_path, "portrl_broken_plugins", PLUGINS, MODULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    monkeypatch.setattr(engine_registry, "_registered", dict(engine_registry._registered))
    reset_plugins()
    yield tmp_path
    reset_plugins()


def test_broken_backends_are_recorded_and_the_others_work(broken):
    assert backend_names() == ["npu", "rocm", "cuda", "cpu"]
    assert get_backend("cpu").probe().usable
    found = broken_backends()
    assert found["xpu"] == ("portrl_test_xpu_broken:XPUBackend",
                            "ImportError: libfoo.so: cannot open shared object file")
    assert found["wrong"][0] == "portrl_test_wrong:Nothing" and "is not a portrl Backend subclass" in found["wrong"][1]
    with pytest.raises(BackendError) as err:
        get_backend("xpu", "--device")
    assert str(err.value) == ("device 'xpu' (from --device): its plugin portrl_test_xpu_broken:XPUBackend is broken: "
                              "ImportError: libfoo.so: cannot open shared object file; working backends: npu, rocm, "
                              "cuda, cpu (see `portrl devices`)")


class Offering(Backend):
    name = "testdev"

    def rollout_engines(self):
        return ("turbo", "odd", "hf")

    def supports_bf16(self):
        return False

    def fp8_dtype(self):
        return None

    def memory_stats(self):
        return {}

    def reset_peak_memory(self):
        pass

    def memory_available(self):
        return None


def test_broken_engines_are_recorded_and_the_others_work(broken):
    assert {"turbo", "odd", "hf"} <= set(engine_names())  # declared names stay known (config checks accept them)
    assert choose_engine("auto", Offering()) == "hf"  # auto skips what does not load
    with pytest.raises(RolloutEngineError) as err:
        choose_engine("turbo", Offering())
    assert str(err.value) == ("rollout engine 'turbo': plugin portrl_test_turbo_broken:TurboEngine failed to load: "
                              "ImportError: libfoo.so: cannot open shared object file")
    assert isinstance(err.value, UserError)
    with pytest.raises(RolloutEngineError, match=r"rollout engine 'odd': plugin portrl_test_wrong:Nothing failed to "
                                                  r"load: TypeError: .* is not a portrl RolloutEngine"):
        choose_engine("odd", Offering())
    assert set(broken_engines()) == {"turbo", "odd"}


def test_devices_lists_broken_plugins(broken, capsys):
    assert main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    backends = {r["name"]: r for r in rows if r["kind"] == "backend"}
    engines = {r["name"]: r for r in rows if r["kind"] == "rollout_engine"}
    assert backends["cpu"]["usable"] and not backends["xpu"]["usable"]
    assert backends["xpu"]["error"] == "ImportError: libfoo.so: cannot open shared object file"
    assert backends["xpu"]["plugin"] == "portrl_test_xpu_broken:XPUBackend"
    assert set(engines) == {"turbo", "odd"} and "ImportError: libfoo.so" in engines["turbo"]["error"]
    assert engines["turbo"]["plugin"] == "portrl_test_turbo_broken:TurboEngine"
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("npu")  # the backend table comes first, unchanged
    assert "plugins that failed to load:" in out
    assert ("  backend xpu: plugin portrl_test_xpu_broken:XPUBackend failed to load: ImportError: libfoo.so: cannot "
            "open shared object file") in out
    assert "  rollout engine turbo: plugin portrl_test_turbo_broken:TurboEngine failed to load: ImportError" in out


def test_devices_lists_a_broken_algorithm_plugin(broken, capsys):
    """The algorithm group is isolated as the others: its broken plugin is a row of its own, in the same format."""
    assert main(["devices", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["kind"] == "algorithm"]
    assert rows == [{"kind": "algorithm", "name": "fancy", "usable": False, "plugin": "portrl_test_fancy_algo",
                     "error": "ModuleNotFoundError: No module named 'fancy_math'",
                     "reason": "plugin portrl_test_fancy_algo failed to load: ModuleNotFoundError: No module named "
                               "'fancy_math'"}]
    assert main(["devices"]) == 0
    assert ("  algorithm plugin fancy: plugin portrl_test_fancy_algo failed to load: ModuleNotFoundError: No module "
            "named 'fancy_math'") in capsys.readouterr().out.splitlines()
    assert "gae" in algo_registry.registered("adv_estimator")  # the built-ins still work


def test_a_name_two_plugins_claim_is_broken_in_every_group(broken):
    """The three groups share one loader: a name two installed distributions declare differently is unusable in
    each, with the same message, and the other plugins of the group still load."""
    write_plugin(broken, "portrl_second_plugins", {"portrl.rollout_engines": [("turbo", "portrl_test_wrong:Other")],
                                                   "portrl.algorithms": [("fancy", "portrl_test_wrong")]}, {})
    reset_plugins()
    for found, kind in ((broken_engines(), "rollout engine"), (algo_registry.load_plugins(), "algorithm")):
        name = "turbo" if kind == "rollout engine" else "fancy"
        assert found[name].error.startswith(f"two plugins claim {kind} {name!r}: "), found[name]
        assert found[name].message == f"plugin {found[name].value} failed to load: {found[name].error}"
    assert choose_engine("auto", Offering()) == "hf"


def test_asking_for_a_broken_plugin_exits_2_with_one_line(broken):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken), os.environ.get("PYTHONPATH", "")]),
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    env.pop("PORTRL_DEBUG", None)
    env.pop("PORTRL_DEVICE", None)
    portrl = Path(sys.executable).parent / "portrl"
    proc = subprocess.run([str(portrl), "doctor", "--device", "xpu"], capture_output=True, text=True, env=env,
                          cwd=broken, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("portrl doctor: error: device 'xpu' (from --device): its plugin "
                                   "portrl_test_xpu_broken:XPUBackend is broken: ImportError: libfoo.so: cannot open "
                                   "shared object file; working backends: npu, rocm, cuda, cpu (see `portrl devices`)")
    proc = subprocess.run([str(portrl), "devices"], capture_output=True, text=True, env=env, cwd=broken,
                          timeout=120)
    assert proc.returncode == 0 and "backend xpu: plugin portrl_test_xpu_broken:XPUBackend failed" in proc.stdout
    proc = subprocess.run([str(portrl), "train", "rollout.engine=turbo", f"trainer.output_dir={broken / 'out'}"],
                          capture_output=True, text=True, env=env, cwd=broken, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("portrl train: error: rollout engine 'turbo': plugin "
                                   "portrl_test_turbo_broken:TurboEngine failed to load: ImportError: libfoo.so: "
                                   "cannot open shared object file")
