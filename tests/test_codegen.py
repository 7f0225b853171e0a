"""The generator: committed output is current, CLI errors are clear, the cache keys on
content, and a real nvcc build of the routing kernels links and then hits the cache."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from codegen import cache, render
from codegen.build import build, compile_flags
from codegen.configs import KERNELS, KernelConfig
from codegen.paths import REPO_ROOT, generated_dir, library_name, templates_dir
from codegen.toolchain import Toolchain
from codegen.wheel import BUNDLED_DIR, build_wheel, platform_tag
import moe_cutlass
from moe_cutlass import _lib, ops

ARCH = "sm90"


def codegen_cli(*args):
    return subprocess.run([sys.executable, "-m", "codegen", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def test_committed_generated_matches_templates(tmp_path):
    render.write(render.render(ARCH), tmp_path)
    committed = sorted(p.name for p in generated_dir(ARCH).iterdir() if p.is_file())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed, "run `python -m codegen --render-only`"
    for name in committed:
        assert (tmp_path / name).read_bytes() == (generated_dir(ARCH) / name).read_bytes(), (
            f"generated/{ARCH}/{name} is stale: run `python -m codegen --arch {ARCH} --render-only`")


def test_render_is_deterministic_and_bannered():
    first, second = render.render(ARCH).files, render.render(ARCH).files
    assert first == second
    for name, text in first.items():
        assert "do not edit" in text.lower(), name


def test_write_removes_stale_files(tmp_path):
    (tmp_path / "old_kernel.cu").write_text("stale")
    render.write(render.render(ARCH), tmp_path)
    assert not (tmp_path / "old_kernel.cu").exists()


def test_header_lists_every_exported_function_and_is_plain_c(tmp_path):
    files = render.render(ARCH).files
    manifest = json.loads(files[render.MANIFEST])
    header = files[render.header_name(ARCH)]
    for kernel in manifest["kernels"]:
        for fn in kernel["functions"]:
            assert f"{fn['name']}(" in header
            _lib.ctype_of(fn["return"])  # every type the ABI uses has a ctypes mapping
            for p in fn["params"]:
                _lib.ctype_of(p["type"])
    nvcc = shutil.which("nvcc")
    cuda_homes = [os.environ.get("CUDA_HOME"), nvcc and Path(os.path.realpath(nvcc)).parent.parent, "/usr/local/cuda"]
    includes = [Path(h) / "include" for h in cuda_homes if h and (Path(h) / "include" / "cuda_runtime_api.h").is_file()]
    if not includes or shutil.which("cc") is None:
        pytest.skip("no CUDA headers or C compiler to compile the header as C")
    (tmp_path / render.header_name(ARCH)).write_text(header)
    (tmp_path / "use.c").write_text(f'#include "{render.header_name(ARCH)}"\n')
    subprocess.run(["cc", "-fsyntax-only", "-Wall", "-Werror", f"-I{includes[0]}", str(tmp_path / "use.c")], check=True)


def test_routing_abi():
    manifest = json.loads(render.render(ARCH).files[render.MANIFEST])
    routing = next(k for k in manifest["kernels"] if k["name"] == "routing")
    names = [fn["name"] for fn in routing["functions"]]
    assert names == ["mc_expand_i32", "mc_expand_i64", "mc_expand_workspace_ints", "mc_finalize", "mc_layer",
                     "mc_layer_graph_count", "mc_layer_release", "mc_abi", "mc_error_string"]
    for fn in routing["functions"]:
        if fn["name"] == "mc_layer":  # its stream travels in the argument block
            assert [p["type"] for p in fn["params"]] == ["void*"]
        elif fn["return"] == "int":  # status-returning launchers take the stream last
            assert fn["params"][-1]["type"] == "cudaStream_t", fn["name"]


def test_list_shows_the_table():
    proc = codegen_cli("--arch", ARCH, "--list")
    assert proc.returncode == 0, proc.stderr
    for cfg in KERNELS[ARCH]:
        assert cfg.name in proc.stdout and cfg.template in proc.stdout


def test_unknown_arch_names_the_valid_ones():
    proc = codegen_cli("--arch", "sm75", "--list")
    assert proc.returncode != 0
    assert "sm75" in proc.stderr and ARCH in proc.stderr


def test_unknown_config_names_the_valid_ones():
    proc = codegen_cli("--arch", ARCH, "--only", "routing,no_such_kernel")  # fails before rendering anything
    assert proc.returncode != 0
    assert "no_such_kernel" in proc.stderr and "routing" in proc.stderr


def test_probe_defines_are_checked_before_anything_is_rendered():
    proc = codegen_cli("--arch", ARCH, "--define", "MC_PROBE_NO_MMA")
    assert proc.returncode == 2 and "--out-dir" in proc.stderr
    proc = codegen_cli("--arch", ARCH, "--define", "X;rm -rf", "--out-dir", "unused")
    assert proc.returncode == 2 and "X;rm -rf" in proc.stderr
    toolchain = Toolchain("nvcc", "", None, ())
    flags = compile_flags(ARCH, toolchain, ["MC_PROBE_NO_CONVERT", "DEPTH=2"])
    assert "-DMC_PROBE_NO_CONVERT" in flags and "-DDEPTH=2" in flags
    with pytest.raises(render.ConfigError, match="NAME or NAME=VALUE"):
        compile_flags(ARCH, toolchain, ["-O0"])


def test_table_errors_are_clear(monkeypatch):
    monkeypatch.setitem(KERNELS, ARCH, [KernelConfig("routing", "routing.cu.j2")] * 2)
    with pytest.raises(render.ConfigError, match="twice"):
        render.render(ARCH)
    monkeypatch.setitem(KERNELS, ARCH, [KernelConfig("routing", "routing.cu")])
    with pytest.raises(render.ConfigError, match=r"\.cu\.j2"):
        render.render(ARCH)


def test_a_template_family_renders_one_source_per_config(tmp_path, monkeypatch):
    # What a GEMM family looks like to the generator: params become template variables,
    # the .h.j2 declares per-config symbols (so it must use {{ name }} or a param).
    (tmp_path / "demo.cu.j2").write_text(
        "constexpr int kTileM = {{ tile_m }};\n"
        'extern "C" int mc_demo_{{ name }}(int32_t n, cudaStream_t stream) { return n * kTileM; }\n')
    (tmp_path / "demo.h.j2").write_text("int mc_demo_{{ name }}(int32_t n, cudaStream_t stream);\n")
    monkeypatch.setitem(KERNELS, ARCH, [KernelConfig("a", "demo.cu.j2", {"tile_m": 64}),
                                        KernelConfig("b", "demo.cu.j2", {"tile_m": 128})])
    files = render.render(ARCH, templates=tmp_path).files
    assert "constexpr int kTileM = 128;" in files["b.cu"]
    assert "int mc_demo_a(" in files[render.header_name(ARCH)] and "int mc_demo_b(" in files[render.header_name(ARCH)]
    manifest = json.loads(files[render.MANIFEST])
    assert [(k["name"], k["params"], k["source"]) for k in manifest["kernels"]] == [
        ("a", {"tile_m": 64}, "a.cu"), ("b", {"tile_m": 128}, "b.cu")]

    (tmp_path / "demo.h.j2").write_text("int mc_demo(int32_t n, cudaStream_t stream);\n")
    with pytest.raises(render.ConfigError, match="exported by both"):
        render.render(ARCH, templates=tmp_path)
    monkeypatch.setitem(KERNELS, ARCH, [KernelConfig("a", "demo.cu.j2", {})])  # tile_m missing
    with pytest.raises(render.ConfigError, match="tile_m"):
        render.render(ARCH, templates=tmp_path)


def test_parse_declarations():
    fns = render.parse_declarations(
        "/* c */ int f(const int32_t * a, void *b, cudaStream_t s);\nconst char *g(void); // x\n", "t")
    assert fns == [
        {"name": "f", "return": "int", "params": [
            {"type": "const int32_t*", "name": "a"}, {"type": "void*", "name": "b"},
            {"type": "cudaStream_t", "name": "s"}]},
        {"name": "g", "return": "const char*", "params": []},
    ]
    with pytest.raises(render.ConfigError):
        render.parse_declarations("int f(int);", "t")  # unnamed parameter


def _routing_source(templates):
    return render.render(ARCH, templates=templates).files["routing.cu"]


def test_cache_key_follows_content(tmp_path):
    header = tmp_path / "dep.h"
    header.write_text("#define A 1\n")
    flags = ["-O3", "-DNDEBUG"]
    source = _routing_source(templates_dir(ARCH))

    def key(version="nvcc 13.0", flags=flags, source=source):
        return cache.object_key(cache.source_key(version, flags, source), [str(header)])

    base = key()
    assert key() == base  # same inputs, same key
    assert _routing_source(templates_dir(ARCH)) == source  # re-rendering changes nothing
    assert key(flags=[*flags, "-G"]) != base
    assert key(version="nvcc 13.1") != base

    edited = tmp_path / "templates"
    shutil.copytree(templates_dir(ARCH), edited)
    with open(edited / "routing.cu.j2", "a") as f:
        f.write("// a template edit\n")
    assert key(source=_routing_source(edited)) != base

    header.write_text("#define A 2\n")  # an included header's content changes
    assert key() != base
    header.unlink()
    assert key() is None  # a vanished header is a miss, not an error


def test_parse_depfile():
    text = "x.o : x.cu \\\n    /a/b.h \\\n    /c/d.cuh\n"
    assert cache.parse_depfile(text) == ["/a/b.h", "/c/d.cuh", "x.cu"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_routing_builds_then_hits_the_cache(tmp_path):
    gen = tmp_path / "generated"
    render.write(render.render(ARCH), gen)
    lines = []
    library = build(ARCH, only=["routing"], gen_dir=gen, out_dir=tmp_path / "build", emit=lines.append)
    assert library.is_file()
    report = json.loads((tmp_path / "build" / "build_report.json").read_text())
    routing = report["objects"]["routing"]
    assert routing["cached"] is False and routing["spill_bytes"] == 0
    assert all(k["registers"] > 0 for k in routing["kernels"])
    assert any("compiling routing" in line for line in lines)

    start = time.monotonic()
    build(ARCH, only=["routing"], gen_dir=gen, out_dir=tmp_path / "build", emit=lines.append)
    assert time.monotonic() - start < 10
    report = json.loads((tmp_path / "build" / "build_report.json").read_text())
    assert report["objects"]["routing"]["cached"] is True

    lib = _lib.Library(library)  # loads without a GPU: the static cudart needs the driver only at first use
    assert lib.kernels == ["routing"]
    assert json.loads(library.with_suffix(".manifest.json").read_text())["defines"] == []
    assert lib.call("mc_error_string", 0) == b"no error"
    assert lib.call("mc_expand_workspace_ints", 1, 8, 128) == 0
    assert lib.call("mc_expand_workspace_ints", 65536, 8, 128) == 512 * 128   # 1024-slot tiles


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_a_probe_build_compiles_is_marked_and_kept_apart(tmp_path):
    """Every development probe on one GEMM: the macros swap declarations and paths in and out, so only a
    compile with them catches a name they leave undeclared (kWidthStep was, sessions 31-35)."""
    gen = tmp_path / "generated"
    render.write(render.render(ARCH), gen)
    probes = ["MC_PROBE_NO_CONVERT", "MC_PROBE_NO_MMA", "MC_PROBE_NO_TOKENS", "MC_PROBE_NO_EPILOGUE",
              "MC_PROBE_NO_LOADS"]
    library = build(ARCH, only=["routing", _first_gemm(1)], gen_dir=gen, out_dir=tmp_path / "probe",
                    emit=lambda line: None, defines=probes)
    assert json.loads(library.with_suffix(".manifest.json").read_text())["defines"] == probes
    assert json.loads((tmp_path / "probe" / "build_report.json").read_text())["defines"] == probes
    with pytest.warns(RuntimeWarning, match="probe build"):
        assert _lib.Library(library).defines == probes


def test_loaded_never_loads_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv(_lib.ENV_VAR, str(tmp_path / "missing.so"))
    _lib.library.cache_clear()
    try:
        assert _lib.loaded() is None   # would raise LibraryNotFound if it tried
    finally:
        _lib.library.cache_clear()


def test_the_library_is_looked_for_in_order(monkeypatch, tmp_path):
    checkout, bundled = tmp_path / "build" / _lib.LIBRARY_NAME, tmp_path / "pkg" / _lib.LIBRARY_NAME
    monkeypatch.setattr(_lib, "CHECKOUT_PATH", checkout)
    monkeypatch.setattr(_lib, "BUNDLED_PATH", bundled)
    monkeypatch.delenv(_lib.ENV_VAR, raising=False)
    _lib.library.cache_clear()
    try:
        with pytest.raises(_lib.LibraryNotFound, match="--wheel") as err:
            _lib.library()
        assert str(checkout) in str(err.value) and str(bundled) in str(err.value)
        bundled.parent.mkdir()
        bundled.write_bytes(b"")
        assert _lib.library_path() == bundled        # a wheel's copy, no checkout beside the package
        checkout.parent.mkdir()
        checkout.write_bytes(b"")
        assert _lib.library_path() == checkout       # a checkout's build is the newer one
        monkeypatch.setenv(_lib.ENV_VAR, str(tmp_path / "mine.so"))
        assert _lib.library_path() == tmp_path / "mine.so"
        with pytest.raises(_lib.LibraryNotFound, match=r"\$MOE_CUTLASS_LIB"):
            _lib.library()
    finally:
        _lib.library.cache_clear()


def _stand_in_library(directory: Path, defines=()) -> Path:
    """A file where the library goes, with its manifest: packaging copies the library without reading it."""
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / library_name(ARCH)
    library.write_bytes(b"a stand-in for the kernel library")
    library.with_suffix(".manifest.json").write_text(json.dumps({"arch": ARCH, "defines": list(defines),
                                                                  "kernels": []}))
    return library


def test_the_wheel_holds_the_package_and_the_library_and_finds_it(tmp_path):
    assert BUNDLED_DIR == _lib.BUNDLED_DIR and library_name(ARCH) == _lib.LIBRARY_NAME
    library = _stand_in_library(tmp_path / "lib")
    wheel = build_wheel(ARCH, library, tmp_path / "dist")
    assert wheel.name.startswith("moe_cutlass-") and wheel.name.endswith(f"-py3-none-{platform_tag()}.whl")
    names = zipfile.ZipFile(wheel).namelist()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {moe_cutlass.__version__}\n" in metadata and "Requires-Dist: torch" in metadata
    assert "# moe_cutlass" in metadata   # README.md, the long description
    bundled = f"moe_cutlass/{BUNDLED_DIR}/{library_name(ARCH)}"
    for name in (bundled, bundled.replace(".so", ".manifest.json"), "moe_cutlass/__init__.py",
                 "moe_cutlass/integrations/transformers.py"):
        assert name in names
    assert not [n for n in names if n.split("/")[0] in ("codegen", "tests", "benchmarks", "templates", "build")
                or "__pycache__" in n]
    # Installed away from any checkout, with MOE_CUTLASS_LIB unset, the package finds the library inside itself.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != _lib.ENV_VAR}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", "import moe_cutlass, moe_cutlass._lib as l; "
                           "print(moe_cutlass.__file__); print(l.library_path())"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    package_file, path = proc.stdout.split()
    assert Path(package_file).parent == site / "moe_cutlass"
    assert Path(path) == site / bundled


def test_a_wheel_takes_only_a_whole_real_library(tmp_path):
    probe = _stand_in_library(tmp_path / "probe", defines=["MC_PROBE_NO_MMA"])
    with pytest.raises(render.ConfigError, match="probe build"):
        build_wheel(ARCH, probe, tmp_path / "dist")
    with pytest.raises(render.ConfigError, match="missing"):
        build_wheel(ARCH, tmp_path / "none" / library_name(ARCH), tmp_path / "dist")
    proc = codegen_cli("--arch", ARCH, "--only", "routing", "--wheel", str(tmp_path / "dist"))
    assert proc.returncode == 2 and "--wheel" in proc.stderr
    assert not (tmp_path / "dist").exists()


def _first_gemm(kind, tile_m=128):
    return next(c.name for c in KERNELS[ARCH] if c.params.get("kind") == kind and c.params.get("tile_m") == tile_m)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_gemm_instantiations_compile_without_spills_and_use_hgmma(tmp_path):
    """CI has no GPU, but a broken GEMM template must still fail it: compile one of each kind, and one
    192-row tile (three consumer warpgroups: our fork of the kernel, moe_gemm_kernel.hpp); and an ABI that
    the package does not mirror (templates/sm90/moe_layer_call.h) must fail it too."""
    gen = tmp_path / "generated"
    render.write(render.render(ARCH), gen)
    names = [_first_gemm(1), _first_gemm(2), _first_gemm(1, tile_m=192)]
    library = build(ARCH, only=names + ["routing"], gen_dir=gen, out_dir=tmp_path / "build", emit=print)
    # the argument block and the prepared layout as compiled are the package's (loading needs no GPU)
    ops.check_abi(_lib.Library(library))
    report = json.loads((tmp_path / "build" / "build_report.json").read_text())
    for name in names:
        obj = report["objects"][name]
        assert obj["spill_bytes"] == 0, f"{name} spills"
        assert obj["gmma_notes"] == {}, f"{name}: ptxas serialized its GMMAs {obj['gmma_notes']}"
        assert all(k["registers"] > 0 for k in obj["kernels"])
        assert 100_000 < obj["dynamic_smem_bytes"] <= 227 * 1024, "pipeline stages should fill shared memory"
        if report["cuobjdump"] is not None:
            assert obj["hgmma"] is True, f"{name}: no HGMMA in the SASS (or cuobjdump failed: False / None)"


def test_the_report_catches_serialized_gmmas():
    """ptxas's notes that GMMAs lost their overlap (seen when a runtime test sat among a k tile's
    GMMAs: every GEMM ran twice as slow) are counted per code; the usual ptxas -v lines are not."""
    from codegen import report

    kernel = "_ZN7cutlass13device_kernelI"
    log = "\n".join([
        f"ptxas info    : Compiling entry function '{kernel}' for 'sm_90a'",
        f"ptxas info    : (C7519) warpgroup.arrive is injected in around line 1905 by compiler to allow use of "
        f"registers in GMMA in function '{kernel}'",
        f"ptxas info    : (C7519) warpgroup.arrive is injected in around line 1929 by compiler to allow use of "
        f"registers in GMMA in function '{kernel}'",
        "ptxas info    : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "the presence of Extern calls",
        "ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem",
    ])
    assert report.gmma_notes(log) == {"C7510": 1, "C7519": 2}
    assert report.gmma_notes(log.split("\n")[0] + "\n" + log.split("\n")[-1]) == {}
