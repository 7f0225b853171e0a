"""Compiles generated/<arch>/*.cu (cached, in parallel) and links one C-ABI library.

Outputs in build/<arch>/: lib<...>.so, lib<...>.manifest.json (the manifest of what the
library holds: it makes the library self-describing), build_report.json, obj/ (cache).
A probe build (defines: preprocessor macros such as the mainloop's MC_PROBE_NO_CONVERT) records
its macros in both files; moe_cutlass warns when it loads such a library.
"""

import concurrent.futures as futures
import ctypes
import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import cache, report
from .configs import ARCH_FLAGS
from .paths import build_dir, generated_dir, library_name, templates_dir
from .render import MANIFEST, ConfigError
from .toolchain import Toolchain, detect

# KERNEL_NOTES E: -DNDEBUG always (device asserts make ptxas serialize WGMMAs).
COMPILE_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-Xptxas", "-v")
# Static cudart: the library then needs only the driver on the target machine, whatever
# runtime torch bundles. -z defs turns a missing symbol into a link error, not a dlopen one.
LINK_FLAGS = ("-shared", "-cudart", "static", "-Xlinker", "-z,defs")
RAM_PER_COMPILE = 4.5 * 2**30  # one CUTLASS instantiation, measured (KERNEL_NOTES E)
MAX_JOBS = 4
HEARTBEAT_S = 20.0


class BuildError(RuntimeError):
    """A compile or the link failed; the message carries the command and its output."""


# A macro as `--define` takes it: NAME or NAME=VALUE, nothing the shell or nvcc would split.
DEFINE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?")


def check_defines(defines) -> None:
    bad = [d for d in defines if not DEFINE_RE.fullmatch(d)]
    if bad:
        raise ConfigError(f"--define {bad[0]!r} is not NAME or NAME=VALUE (letters, digits, _ . + -)")


def compile_flags(arch: str, toolchain: Toolchain, defines=()) -> list:
    includes = [templates_dir(arch), *toolchain.cutlass_includes]
    check_defines(defines)
    return [*COMPILE_FLAGS, *ARCH_FLAGS[arch], *(f"-D{d}" for d in defines), *(f"-I{d}" for d in includes)]


def _available_ram() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return RAM_PER_COMPILE


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, int(_available_ram() // RAM_PER_COMPILE), MAX_JOBS))


class Progress:
    """Timestamped lines, so a long compile never looks like a hang."""

    def __init__(self, emit=None):
        self._start = time.monotonic()
        self._emit = emit or (lambda line: print(line, flush=True))
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def __call__(self, message: str) -> None:
        with self._lock:
            self._emit(f"[codegen {self.elapsed():7.1f}s] {message}")


@dataclass
class ObjectResult:
    name: str
    path: Path
    record: dict  # sidecar: kernels (ptxas), hgmma, compile_seconds, command
    cached: bool
    seconds: float = 0.0


@dataclass
class Build:
    arch: str
    toolchain: Toolchain
    flags: list
    obj_dir: Path
    progress: Progress
    digests: cache.HeaderDigests = field(default_factory=cache.HeaderDigests)
    running: dict = field(default_factory=dict)  # name -> start time, for the heartbeat

    def _cached(self, name: str, skey: str) -> Path | None:
        deps = self.obj_dir / f"{name}.{skey[:16]}.deps.json"
        if not deps.is_file():
            return None
        okey = cache.object_key(skey, json.loads(deps.read_text())["headers"], self.digests)
        if okey is None:
            return None
        obj = self.obj_dir / f"{name}.{okey[:16]}.o"
        return obj if obj.is_file() and obj.with_suffix(".json").is_file() else None

    def object_file(self, name: str, source: Path) -> ObjectResult:
        skey = cache.source_key(self.toolchain.nvcc_version, self.flags, source.read_text())
        lock = self.obj_dir / f"{name}.{skey[:16]}.lock"
        with cache.locked(lock, on_wait=lambda: self.progress(f"waiting for another process building {name}")):
            hit = self._cached(name, skey)
            if hit is not None:
                return ObjectResult(name, hit, json.loads(hit.with_suffix(".json").read_text()), cached=True)
            return self._compile(name, source, skey)

    def _compile(self, name: str, source: Path, skey: str) -> ObjectResult:
        start = time.monotonic()
        self.running[name] = start
        self.progress(f"compiling {name}")
        tmp_obj = cache.temp_path(self.obj_dir / f"{name}.o")
        tmp_dep = cache.temp_path(self.obj_dir / f"{name}.d")
        try:
            compile_cmd = [self.toolchain.nvcc, *self.flags, "-c", str(source)]
            cmd = [*compile_cmd, "-o", str(tmp_obj), "-MD", "-MF", str(tmp_dep)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"compiling {name} failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            headers = cache.parse_depfile(tmp_dep.read_text())
            okey = cache.object_key(skey, headers, self.digests)
            kernels = report.parse_ptxas(proc.stdout + proc.stderr)
            notes = report.gmma_notes(proc.stdout + proc.stderr)
            seconds = time.monotonic() - start
            record = {
                "command": compile_cmd,
                "compile_seconds": round(seconds, 1),
                "hgmma": report.has_hgmma(self.toolchain.cuobjdump, str(tmp_obj)),
                "kernels": kernels,
                "gmma_notes": notes,
            }
            obj = self.obj_dir / f"{name}.{okey[:16]}.o"
            # The .o appears last: its presence means the sidecar and deps are complete.
            cache.publish_text(obj.with_suffix(".json"), json.dumps(record, indent=2) + "\n")
            cache.publish_text(self.obj_dir / f"{name}.{skey[:16]}.deps.json", json.dumps({"headers": headers}) + "\n")
            os.replace(tmp_obj, obj)
        finally:
            self.running.pop(name, None)
            for tmp in (tmp_obj, tmp_dep):
                tmp.unlink(missing_ok=True)
        summary = report.summarize(kernels)
        self.progress(
            f"built {name} in {seconds:.1f}s: {len(kernels)} kernels, max {summary['max_registers']} registers, "
            f"{summary['spill_bytes']} spill bytes"
            + (f"; WARNING: ptxas serialized its GMMAs ({', '.join(f'{c} x{n}' for c, n in notes.items())})"
               if notes else "")
        )
        return ObjectResult(name, obj, record, cached=False, seconds=seconds)


def _select(manifest: dict, only) -> list:
    kernels = manifest["kernels"]
    if not only:
        return kernels
    names = [k["name"] for k in kernels]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(f"unknown config {', '.join(unknown)} for {manifest['arch']}; valid: {', '.join(names)}")
    return [k for k in kernels if k["name"] in only]


def _compile_all(build: Build, sources: dict, jobs: int) -> dict:
    results = {}
    with futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = {pool.submit(build.object_file, name, path): name for name, path in sources.items()}
        failure = None
        while pending:
            done, _ = futures.wait(pending, timeout=HEARTBEAT_S, return_when=futures.FIRST_COMPLETED)
            for fut in done:
                name = pending.pop(fut)
                try:
                    results[name] = fut.result()
                except Exception as exc:  # finish the running compiles, then report the first failure
                    failure = failure or exc
                    for other in pending:
                        other.cancel()
            if not done and build.running:
                now = time.monotonic()
                running = build.running.copy()  # workers add and remove entries meanwhile
                still = ", ".join(f"{n} ({now - t:.0f}s)" for n, t in sorted(running.items()))
                build.progress(f"still compiling: {still}")
            pending = {f: n for f, n in pending.items() if not f.cancelled()}
        if failure is not None:
            raise failure
    return results


def _link(build: Build, objects: list, library: Path, lib_manifest: dict) -> bool:
    """Links unless the library beside its manifest already holds exactly these objects."""
    manifest_path = library.with_suffix(".manifest.json")
    link_key = cache.source_key(build.toolchain.nvcc_version, LINK_FLAGS, "\n".join(str(o) for o in objects))
    lib_manifest = {**lib_manifest, "link_key": link_key}
    with cache.locked(library.with_suffix(".lock")):
        if library.is_file() and manifest_path.is_file():
            if json.loads(manifest_path.read_text()).get("link_key") == link_key:
                return False
        tmp = cache.temp_path(library)
        try:
            cmd = [build.toolchain.nvcc, *LINK_FLAGS, "-o", str(tmp), *map(str, objects)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"linking {library.name} failed:\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            os.replace(tmp, library)
        finally:
            tmp.unlink(missing_ok=True)
        cache.publish_text(manifest_path, json.dumps(lib_manifest, indent=2, sort_keys=True) + "\n")
    return True


def _add_dynamic_smem(objects: dict, library: Path, arch: str) -> None:
    """ptxas sees static shared memory only; kernels sized at launch (the CUTLASS GEMMs) export
    `<symbol>_shared_memory_bytes`, read here from the linked library (host code: no GPU needed)."""
    lib = ctypes.CDLL(str(library))
    for name, obj in objects.items():
        query = getattr(lib, f"mc_{arch}_{name}_shared_memory_bytes", None)
        if query is not None:
            query.restype = ctypes.c_size_t
            obj["dynamic_smem_bytes"] = int(query())


def build(arch: str, only=None, jobs: int | None = None, gen_dir: Path | None = None,
          out_dir: Path | None = None, emit=None, defines=()) -> Path:
    """Builds the library from the rendered sources; returns its path. defines: extra macros for
    every compile (probe builds; kept out of build/<arch> by giving them their own out_dir)."""
    if arch not in ARCH_FLAGS:
        raise ConfigError(f"unknown arch {arch!r}; valid: {', '.join(sorted(ARCH_FLAGS))}")
    gen_dir = gen_dir or generated_dir(arch)
    out_dir = out_dir or build_dir(arch)
    manifest_file = gen_dir / MANIFEST
    if not manifest_file.is_file():
        raise ConfigError(f"{manifest_file} missing: run `python -m codegen --arch {arch} --render-only` first")
    manifest = json.loads(manifest_file.read_text())
    kernels = _select(manifest, only)
    progress = Progress(emit)
    toolchain = detect()
    jobs = max(1, min(jobs or default_jobs(), len(kernels)))
    obj_dir = out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    defines = list(defines)
    b = Build(arch, toolchain, compile_flags(arch, toolchain, defines), obj_dir, progress)
    progress(f"{arch}: {len(kernels)} objects, up to {jobs} compiles at a time")
    results = _compile_all(b, {k["name"]: gen_dir / k["source"] for k in kernels}, jobs)

    library = out_dir / library_name(arch)
    objects = [results[k["name"]].path for k in kernels]
    linked = _link(b, objects, library, {**manifest, "kernels": kernels, "defines": defines})
    progress(f"{'linked' if linked else 'up to date'}: {library}")

    build_report = {
        "arch": arch,
        "library": str(library),
        "nvcc": next((l for l in toolchain.nvcc_version.splitlines() if "release" in l), toolchain.nvcc_version.strip()),
        "cuobjdump": toolchain.cuobjdump,
        "defines": defines,
        "objects": {
            r.name: {
                "object": str(r.path),
                "cached": r.cached,
                **{k: r.record[k] for k in ("compile_seconds", "hgmma", "kernels")},
                "gmma_notes": r.record.get("gmma_notes", {}),
                **report.summarize(r.record["kernels"]),
            }
            for r in (results[k["name"]] for k in kernels)
        },
    }
    _add_dynamic_smem(build_report["objects"], library, arch)
    cache.publish_text(out_dir / "build_report.json", json.dumps(build_report, indent=2) + "\n")
    cached = sum(r.cached for r in results.values())
    progress(f"done: {len(results) - cached} compiled, {cached} cached, report {out_dir / 'build_report.json'}")
    return library
