"""The bare-stream floor: how long one kernel takes just to read a layer's weights on this device.

usage: python -m benchmarks.stream_floor [--configs a,b] [--ms 1,4,16,64] [--reps 100] [--out-dir DIR]

The layer's floor (DESIGN.md 5) divides the active experts' MXFP4 bytes by the copy rate of a 1 GB
copy. A short read does not reach that rate (at one token the weights are 20-190 MB): its start and
end cost microseconds. For each shape and M this times, in one run and as the layer benchmark does (CUDA-graph
replay, L2 flushed before each rep, median):
  moe_cutlass     fused_moe, the layer itself;
  bare_stream     benchmarks/stream_floor.cu reading the same bytes (the floor's bytes: the active
                  experts' weights at 4.25 bits per weight and the activations in and out) from one
                  contiguous buffer, one CTA per SM, with no work on them;
  bare_stream_x2  the same bytes in two such launches, GEMM1's share (2/3 of the weights) then GEMM2's:
                  a layer reads its weights in two dependent phases;
  copy            a device copy moving as many bytes (half read, half written: the floor's method).
Writes a "bench" record (rows as bench_moe's, relerr null) with the floors measured in the same run.
The stream kernel is built here with nvcc (no CUTLASS needed) into build/stream_floor/.
"""
import argparse
import ctypes
import hashlib
import statistics
import subprocess
from pathlib import Path

import torch

import moe_cutlass as mc
from benchmarks.bench_moe import (CONFIGS, Timer, floor_bytes, floor_us, graph_of, measure_floors, random_batch,
                                  random_experts)
from benchmarks.record import record_main
from codegen.configs import ARCH_FLAGS
from codegen.toolchain import compiler

SOURCE = Path(__file__).resolve().parent / "stream_floor.cu"
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "stream_floor"
HELPERS = Path(__file__).resolve().parent.parent / "templates" / "sm90"   # moe_decode.cuh and its headers
DECODE_TOKENS = (1, 4, 16, 64)


def build_library(arch="sm90") -> Path:
    """The stream kernel's shared library, rebuilt when the source or the compiler changes."""
    nvcc, version = compiler()
    text = "".join(f.read_text() for f in [SOURCE, *sorted(HELPERS.glob("*.cuh")), *sorted(HELPERS.glob("*.h"))])
    key = hashlib.sha256((text + version + arch).encode()).hexdigest()[:16]
    path = BUILD_DIR / f"libstream_floor.{key}.so"
    if not path.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        cmd = [nvcc, "-std=c++17", "-O3", *ARCH_FLAGS[arch], f"-I{HELPERS}", "-Xcompiler", "-fPIC", "-shared",
               "-cudart", "static", "-o", str(tmp), str(SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}{result.stderr}")
        tmp.rename(path)
    return path


class Stream:
    """mc_bench_stream of the built library: stream(buffer, bytes) reads the buffer's first bytes."""

    def __init__(self, path):
        lib = ctypes.CDLL(str(path))
        status = lib.mc_bench_stream_init()
        if status != 0:
            raise RuntimeError(f"mc_bench_stream_init: CUDA error {status}")
        self._fn = lib.mc_bench_stream
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p]

    def __call__(self, buffer, nbytes, checksum=None):
        if not (buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.is_contiguous()):
            raise ValueError("buffer: expected a contiguous uint8 CUDA tensor")
        if not 0 <= nbytes <= buffer.numel():
            raise ValueError(f"nbytes: expected 0..{buffer.numel()} (the buffer's bytes), got {nbytes}")
        status = self._fn(buffer.data_ptr(), nbytes, None if checksum is None else checksum.data_ptr(),
                          torch.cuda.current_stream().cuda_stream)
        if status != 0:
            raise RuntimeError(f"mc_bench_stream: CUDA error {status} ({nbytes} bytes)")


def round16(n: float) -> int:
    return int(-(-int(n) // 16) * 16)


def stream_bytes(M, E, H, I, ids):
    """(all bytes, GEMM1's share, GEMM2's share) of bench_moe.floor_bytes, in whole 16-byte pieces."""
    w1, w2, act = floor_bytes(M, E, H, I, ids)
    return round16(w1 + w2 + act), round16(w1 + act / 2), round16(w2 + act / 2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default=",".join(map(str, DECODE_TOKENS)))
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out-dir", default=None)
    return parser.parse_args(argv)


def run(args):
    stream = Stream(build_library())
    timer = Timer(args.reps)
    floors, gen, rows = measure_floors(timer), torch.Generator(device="cuda").manual_seed(0), []
    for name in args.configs.split(","):
        E, H, I, k = CONFIGS[name]
        experts = random_experts(E, H, I, gen)
        for M in (int(m) for m in args.ms.split(",")):
            x, w, ids = random_batch(M, E, H, k, gen)
            floor = floor_us(M, E, H, I, k, ids, floors)
            total, first, second = stream_bytes(M, E, H, I, ids)
            src = torch.empty(first + second + total, dtype=torch.uint8, device="cuda").random_(generator=gen)
            half = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
            out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
            cases = {
                "moe_cutlass": lambda: mc.fused_moe(x, experts, w, ids, out=out),
                "bare_stream": lambda: stream(src, total),
                # GEMM2's share from memory GEMM1's did not read (as in the layer: other matrices)
                "bare_stream_x2": lambda: (stream(src, first), stream(src[total:], second)),
                "copy": lambda: half.copy_(src[:total // 2]),
            }
            for impl, fn in cases.items():
                us = timer.median_us(graph_of(fn).replay)
                rows.append({"impl": impl, "config": name, "M": M, "mode": "graph", "us": us, "floor_us": floor,
                             "relerr": None, "bytes": total})
                print(f"{name:14s} M={M:3d} {impl:15s} {us:8.1f} us  floor {floor:7.1f} us  x{us / floor:5.2f}  "
                      f"({total / 1e6:.1f} MB, {total / (us * 1e-6) / 1e12:.2f} TB/s)", flush=True)
            del src, half
        del experts
        torch.cuda.empty_cache()
    ratios = [r["us"] / s["us"] for r in rows if r["impl"] == "moe_cutlass"
              for s in rows if s["impl"] == "bare_stream" and (s["config"], s["M"]) == (r["config"], r["M"])]
    print(f"moe_cutlass / bare_stream: median {statistics.median(ratios):.2f}, {min(ratios):.2f}..{max(ratios):.2f}")
    return {"floors": floors, "reps": args.reps, "rows": rows}, 0


def main(argv=None):
    return record_main("bench", parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
