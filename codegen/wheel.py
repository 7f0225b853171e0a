"""Packs moe_cutlass and its built kernel library into one wheel (`python -m codegen --arch sm90 --wheel DIR`).

Why: the machine that runs the layer needs no CUDA toolkit (the library links the CUDA runtime statically: a driver
is enough), but until this it needed a source checkout and ~17 minutes of nvcc, or MOE_CUTLASS_LIB pointing at a
library built elsewhere; a non-editable `pip install .` could not find the library at all. The wheel holds the Python
package and, in moe_cutlass/_kernels/, the library and its manifest, where moe_cutlass._lib looks when no checkout
build sits beside the package.

Its tag is py3-none-<this platform>: the library is loaded through ctypes, so any Python 3 can load it, but only on
the platform it was compiled for. Not manylinux: PyPI's tags need `auditwheel repair` first. The generator (codegen/,
templates/) stays out: a top-level package named `codegen` in site-packages could shadow another one, and it is of
no use without the templates. A probe build (--define) is refused: its kernels return wrong results on purpose.
"""

import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .build import BuildError
from .paths import REPO_ROOT, library_name
from .render import ConfigError

PACKAGE = "moe_cutlass"
BUNDLED_DIR = "_kernels"   # must be moe_cutlass._lib.BUNDLED_DIR (tests/test_codegen.py checks)

# setuptools' own PEP 517 backend, in a child process: it works in its current directory and keeps global state.
_BACKEND = ("import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1], "
            "config_settings={'--build-option': ['--plat-name', sys.argv[2]]}))")


def platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def build_wheel(arch: str, library: Path, dist_dir: Path, source_root: Path = REPO_ROOT) -> Path:
    """Writes the wheel of source_root's package with `library` (and its manifest) inside; returns its path."""
    manifest_path = library.with_suffix(".manifest.json")
    if not library.is_file() or not manifest_path.is_file():
        raise ConfigError(f"{library} or its manifest {manifest_path.name} is missing: build the library first "
                          f"(`python -m codegen --arch {arch}`)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("arch") != arch:
        raise ConfigError(f"{library} was built for {manifest.get('arch')!r}, not {arch!r}")
    if manifest.get("defines"):
        raise ConfigError(f"{library} is a probe build (macros {', '.join(manifest['defines'])}): its kernels may skip "
                          "work and return wrong results; a wheel holds only a real library")
    dist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moe_cutlass_wheel_") as tmp:
        stage = Path(tmp) / "src"
        shutil.copytree(source_root / PACKAGE, stage / PACKAGE,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", BUNDLED_DIR))
        for name in ("pyproject.toml", "README.md"):   # the metadata and its long description
            shutil.copy2(source_root / name, stage / name)
        kernels = stage / PACKAGE / BUNDLED_DIR
        kernels.mkdir()
        bundled = kernels / library_name(arch)
        shutil.copy2(library, bundled)
        shutil.copy2(manifest_path, bundled.with_suffix(".manifest.json"))
        out = Path(tmp) / "dist"
        proc = subprocess.run([sys.executable, "-c", _BACKEND, str(out), platform_tag()], cwd=stage,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError("building the wheel failed (it needs setuptools >= 70.1, or the wheel package):\n"
                             f"{proc.stdout}{proc.stderr}")
        name = proc.stdout.strip().splitlines()[-1]
        target = dist_dir / name
        shutil.copy2(out / name, target)
    return target
