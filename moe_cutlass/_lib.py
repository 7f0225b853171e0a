"""Loads the kernel library (a plain C ABI, through ctypes) and calls its functions.

The library is found at $MOE_CUTLASS_LIB, else where a source checkout builds it
(<repo>/build/sm90/libmoe_cutlass_sm90.so, beside this package), else inside the package
(moe_cutlass/_kernels/, where the wheel of `python -m codegen --arch sm90 --wheel DIR` puts it).
Beside it, lib<...>.manifest.json (written by the build) lists the kernels it holds and
the C signature of every exported function; argtypes and restype come from there, so a
pointer is never truncated to a C int. Nothing is loaded at import time.
"""

import ctypes
import functools
import json
import os
import warnings
from pathlib import Path

ENV_VAR = "MOE_CUTLASS_LIB"
ARCH = "sm90"
LIBRARY_NAME = f"libmoe_cutlass_{ARCH}.so"
CHECKOUT_PATH = Path(__file__).resolve().parent.parent / "build" / ARCH / LIBRARY_NAME
BUNDLED_DIR = "_kernels"   # codegen/wheel.py packs the library here
BUNDLED_PATH = Path(__file__).resolve().parent / BUNDLED_DIR / LIBRARY_NAME

# C types the ABI may use. Every pointer (any "T*") is passed as c_void_p.
C_TYPES = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "cudaStream_t": ctypes.c_void_p,
    "const char*": ctypes.c_char_p,
}


def ctype_of(c_type: str):
    if c_type in C_TYPES:
        return C_TYPES[c_type]
    if c_type.endswith("*"):
        return ctypes.c_void_p
    raise TypeError(f"unsupported C type {c_type!r} in the library ABI (supported: {', '.join(C_TYPES)}, pointers)")


class LibraryNotFound(RuntimeError):
    pass


class Library:
    def __init__(self, path: Path):
        manifest_path = path.with_suffix(".manifest.json")
        if not manifest_path.is_file():
            raise LibraryNotFound(f"{manifest_path} missing: the build writes it beside {path.name}; rebuild with "
                                  f"`python -m codegen --arch {ARCH}`")
        self.path = path
        self.manifest = json.loads(manifest_path.read_text())
        if self.defines:
            warnings.warn(f"{path} is a probe build (macros {', '.join(self.defines)}): its kernels "
                          "may skip work and return wrong results", RuntimeWarning, stacklevel=2)
        self._dll = ctypes.CDLL(str(path))
        self.signatures = {fn["name"]: fn for k in self.manifest["kernels"] for fn in k["functions"]}
        self._functions = {}

    @property
    def defines(self) -> list:
        """The macros of a probe build (python -m codegen --define), [] for a real library."""
        return list(self.manifest.get("defines", []))

    @property
    def kernels(self) -> list:
        return [k["name"] for k in self.manifest["kernels"]]

    def function(self, symbol: str):
        """The ctypes function with argtypes/restype from the manifest."""
        if symbol not in self._functions:
            if symbol not in self.signatures:
                raise RuntimeError(f"{symbol} is not in {self.path.name} (it holds kernels: {', '.join(self.kernels)}); "
                                   f"build it with `python -m codegen --arch {ARCH}`")
            sig = self.signatures[symbol]
            fn = getattr(self._dll, symbol)
            fn.restype = ctype_of(sig["return"])
            fn.argtypes = [ctype_of(p["type"]) for p in sig["params"]]
            self._functions[symbol] = fn
        return self._functions[symbol]

    def error_string(self, code: int) -> str:
        if "mc_error_string" not in self.signatures:
            return f"error {code}"
        return self.function("mc_error_string")(code).decode()

    def call(self, symbol: str, *args):
        """Calls `symbol`. A function returning int returns a cudaError_t: non-zero raises."""
        result = self.function(symbol)(*args)
        if self.signatures[symbol]["return"] == "int" and result != 0:
            raise RuntimeError(f"{symbol} failed: {self.error_string(result)} (CUDA error {result})")
        return result


def locate() -> tuple:
    """(where the library is looked for, how that place was chosen): $MOE_CUTLASS_LIB; else the build of the
    checkout this package sits in (what `python -m codegen` just rebuilt, even where a library was also copied into
    the package); else the wheel's copy; else the checkout's path, for the error."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]), f"${ENV_VAR}"
    if BUNDLED_PATH.is_file() and not CHECKOUT_PATH.is_file():
        return BUNDLED_PATH, "the wheel's copy"
    return CHECKOUT_PATH, "the checkout's build"


def library_path() -> Path:
    return locate()[0]


@functools.lru_cache(maxsize=1)
def library() -> Library:
    path, source = locate()
    if not path.is_file():
        where = (f"{source} = {path}" if source == f"${ENV_VAR}"
                 else f"{CHECKOUT_PATH} (a source checkout's build) or {BUNDLED_PATH} (a wheel's)")
        raise LibraryNotFound(f"moe_cutlass kernel library not found at {where}; in a source checkout build it with "
                              f"`python -m codegen --arch {ARCH}` (and keep the install editable, `pip install -e`), "
                              f"or install the wheel that `python -m codegen --arch {ARCH} --wheel DIR` writes, or set "
                              f"{ENV_VAR} to a built library")
    return Library(path)


def loaded() -> Library | None:
    """The library if this process has loaded it, else None (never loads it)."""
    return library() if library.cache_info().currsize else None


def call(symbol: str, *args):
    return library().call(symbol, *args)
