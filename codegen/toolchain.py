"""Finds nvcc, cuobjdump and the CUTLASS headers of the installed nvidia-cutlass wheel."""

import functools
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(RuntimeError):
    """A compiler or header set the build needs is missing."""


@dataclass(frozen=True)
class Toolchain:
    nvcc: str
    nvcc_version: str  # full `nvcc --version` text: part of every cache key
    cuobjdump: str | None
    cutlass_includes: tuple


def _find_nvcc() -> str:
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise ToolchainError("nvcc not found: put it on PATH or set NVCC=/path/to/nvcc")


def _wheel_cuobjdump() -> list:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (nvidia/cu13/bin; the test extra installs it)."""
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec else []
    return sorted(p for root in roots for p in Path(root).glob("cu*/bin/cuobjdump"))


def _find_cuobjdump(nvcc: str) -> str | None:
    # nvcc may be a wrapper script, so also look beside the real compiler.
    real_bin = Path(os.path.realpath(nvcc)).parent
    for path in (shutil.which("cuobjdump"), real_bin / "cuobjdump", "/usr/local/cuda/bin/cuobjdump",
                 *_wheel_cuobjdump()):
        if path and os.access(path, os.X_OK):
            return str(path)
    return None


def cutlass_includes() -> tuple:
    """Include dirs of the CUTLASS headers shipped inside the cutlass_library package."""
    spec = importlib.util.find_spec("cutlass_library")  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError("cutlass_library not installed: pip install 'nvidia-cutlass>=4.2,<4.3'")
    source = Path(spec.submodule_search_locations[0]) / "source"
    dirs = (source / "include", source / "tools" / "util" / "include")
    for d in dirs:
        if not d.is_dir():
            raise ToolchainError(f"CUTLASS headers missing: {d} (reinstall nvidia-cutlass)")
    return tuple(str(d) for d in dirs)


@functools.lru_cache(maxsize=1)
def compiler() -> tuple:
    """(path, full `nvcc --version` text) of nvcc alone, for builds without CUTLASS (benchmarks/stream_floor.py)."""
    nvcc = _find_nvcc()
    return nvcc, subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout


@functools.lru_cache(maxsize=1)
def detect() -> Toolchain:
    nvcc, version = compiler()
    return Toolchain(nvcc, version, _find_cuobjdump(nvcc), cutlass_includes())
