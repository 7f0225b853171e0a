"""`python -m moe_cutlass` (moe_cutlass/env.py): each of the four conditions, faked, and the command on this machine."""

import json
import subprocess
import sys

import pytest

from moe_cutlass import _device, _lib, env, ops
from moe_cutlass._device import DeviceInfo


class FakeLibrary:
    def __init__(self, abi=None, defines=()):
        self.path = "fake.so"
        self.kernels = ["routing", "moe_gemm1"]
        self.defines = list(defines)
        self.signatures = {"mc_abi": {}}
        self._abi = abi if abi is not None else ops.abi()

    def function(self, symbol):
        assert symbol == "mc_abi"
        return lambda: self._abi.encode()


@pytest.fixture
def machine(monkeypatch):
    """An H200 with a CUDA 13.0 driver and a library of this version, until a test changes one of them."""
    state = {"devices": [DeviceInfo(0, "NVIDIA H200", (9, 0), 132)], "driver": "13.0", "library": FakeLibrary()}

    def library():
        if isinstance(state["library"], Exception):
            raise state["library"]
        return state["library"]

    monkeypatch.setattr(_device, "driver_version", lambda: state["driver"])
    monkeypatch.setattr(_device, "device_count", lambda: len(state["devices"]))
    monkeypatch.setattr(_device, "device_info", lambda i: state["devices"][i])
    monkeypatch.setattr(_lib, "library", library)
    return state


def test_ready_where_all_four_hold(machine, capsys):
    r = env.report()
    assert r["ready"] and r["problems"] == []
    assert r["library"]["kernels"] == 2 and r["library"]["abi"] == "matches this package"
    assert r["gpu"]["devices"][0]["sm90"] and r["gpu"]["driver_cuda"] == "13.0"
    assert env.main([]) == 0
    assert "ready: fused_moe can run here" in capsys.readouterr().out
    assert env.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ready"] is True


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(devices=[DeviceInfo(0, "NVIDIA A100", (8, 0), 108)]), ["SM90", "NVIDIA A100 (8.0)"]),
    (lambda m: m.update(devices=[]), ["SM90", "found none"]),
    (lambda m: m.update(driver="12.8"), ["CUDA 12.8", "R580"]),
    (lambda m: m.update(library=_lib.LibraryNotFound("not found at /x.so")), ["kernel library", "/x.so"]),
    (lambda m: m.update(library=FakeLibrary(abi="format 2; McLayerCall hidden@0")), ["another version", "format 2"]),
    (lambda m: m.update(library=FakeLibrary(defines=["MC_PROBE_NO_MMA"])), ["probe build", "MC_PROBE_NO_MMA"]),
])
def test_each_missing_condition_is_named(machine, capsys, change, words):
    change(machine)
    r = env.report()
    assert not r["ready"] and len(r["problems"]) == 1
    assert all(w in r["problems"][0] for w in words), r["problems"]
    assert env.main([]) == 1
    out = capsys.readouterr().out
    assert "not ready" in out and r["problems"][0] in out


def test_no_driver_is_a_problem_not_a_crash(machine, monkeypatch):
    def no_driver():
        raise RuntimeError("CUDA driver unavailable (cuInit): no libcuda")

    monkeypatch.setattr(_device, "driver_version", no_driver)
    r = env.report()
    assert not r["ready"] and r["gpu"]["devices"] == [] and "no libcuda" in r["problems"][0]


def test_the_command_on_this_machine():
    """Whatever this machine has: valid JSON, and the exit status says whether the layer can run."""
    proc = subprocess.run([sys.executable, "-m", "moe_cutlass", "--json"], capture_output=True, text=True)
    r = json.loads(proc.stdout)
    assert proc.returncode == (0 if r["ready"] else 1), proc.stderr
    assert r["moe_cutlass"]["version"] and r["library"]["path"] and r["ready"] == (not r["problems"])
