"""`python -m moe_cutlass`: whether the layer can run here, and the facts a bug report needs.

Why: the layer runs only where four things hold at once (an SM90 GPU, a driver for the CUDA 13 runtime the library
links, a kernel library on the search path, and that library built from this version of the package), and each
otherwise fails at the first call, deep inside an engine's model load. This reports all four without running a
kernel, and exits 0 only when the layer can run: an engine's image can check itself at build time.
"""

import argparse
import json
import os
import platform
import sys

from . import __version__, _device, _lib


def _library_facts() -> dict:
    path, found_by = _lib.locate()
    facts = {"path": str(path), "found_by": found_by}
    try:
        lib = _lib.library()
    except Exception as exc:   # any reason it cannot load is the answer
        return {**facts, "error": str(exc)}
    from . import ops   # here, not at the top: ops imports torch's op registry, which the report does not need

    facts.update(kernels=len(lib.kernels), probe_defines=lib.defines)
    try:
        ops.check_abi(lib)
        facts["abi"] = "matches this package"
    except RuntimeError as exc:
        facts["error"] = str(exc)
    return facts


def _gpu_facts() -> dict:
    try:
        facts = {"driver_cuda": _device.driver_version(), "devices": []}
        for index in range(_device.device_count()):
            info = _device.device_info(index)
            facts["devices"].append({"index": index, "name": info.name, "capability": list(info.capability),
                                     "sm_count": info.sm_count, "sm90": info.capability == (9, 0)})
    except RuntimeError as exc:
        return {"error": str(exc), "devices": []}
    return facts


def report() -> dict:
    import torch

    library, gpu = _library_facts(), _gpu_facts()
    problems = []
    if "error" in library:
        problems.append(f"kernel library: {library['error']}")
    elif library["probe_defines"]:
        problems.append(f"kernel library: a probe build ({', '.join(library['probe_defines'])}) returns wrong results "
                        "on purpose")
    if "error" in gpu:
        problems.append(f"GPU: {gpu['error']}")
    elif not any(d["sm90"] for d in gpu["devices"]):
        found = ", ".join(f"{d['name']} ({d['capability'][0]}.{d['capability'][1]})" for d in gpu["devices"]) or "none"
        problems.append(f"GPU: fused_moe needs an SM90 GPU (H100 / H200 / H20); found {found}")
    elif tuple(map(int, gpu["driver_cuda"].split("."))) < (13, 0):
        problems.append(f"GPU: the driver supports CUDA {gpu['driver_cuda']}; the library links the CUDA 13 runtime "
                        "(an R580 or newer driver)")
    return {
        "moe_cutlass": {"version": __version__, "path": os.path.dirname(os.path.abspath(__file__))},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda},
        "library": library,
        "gpu": gpu,
        "ready": not problems,
        "problems": problems,
    }


def _lines(r: dict) -> list:
    lib, gpu = r["library"], r["gpu"]
    out = [f"moe_cutlass {r['moe_cutlass']['version']} at {r['moe_cutlass']['path']}",
           f"python {r['python']}, torch {r['torch']['version']} (CUDA {r['torch']['cuda']}), {r['platform']}",
           f"kernel library: {lib['path']} (from {lib['found_by']})"]
    if "kernels" in lib:
        out.append(f"  {lib['kernels']} kernels" + (f", probe build: {', '.join(lib['probe_defines'])}"
                                                     if lib["probe_defines"] else "")
                   + (f", ABI {lib['abi']}" if "abi" in lib else ""))
    if "driver_cuda" in gpu:
        out.append(f"driver: CUDA {gpu['driver_cuda']}")
    out += [f"  cuda:{d['index']} {d['name']}, compute capability {d['capability'][0]}.{d['capability'][1]}, "
            f"{d['sm_count']} SMs" for d in gpu["devices"]]
    out.append("ready: fused_moe can run here" if r["ready"] else "not ready:")
    out += [f"  {p}" for p in r["problems"]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_cutlass", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON (for a bug report)")
    args = p.parse_args(argv)
    r = report()
    print(json.dumps(r, indent=2) if args.json else "\n".join(_lines(r)))
    return 0 if r["ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
