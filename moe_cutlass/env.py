"""`python -m moe_cutlass`: whether the layer can run here, and the facts a bug report needs.

Why: the layer runs only where four things hold at once (an SM90 GPU, a driver for the CUDA 13 runtime the library
links, a kernel library on the search path, and that library built from this version of the package), and each
otherwise fails at the first call, deep inside an engine's model load. This reports all four without running a
kernel, and exits 0 only when the layer can run: an engine's image can check itself at build time. With --run it
also runs the layer (small shapes, both activations, eager and CUDA-graph replay) against the float32 reference: what
the four facts cannot show, such as a driver that loads the library but cannot run its kernels.
"""

import argparse
import json
import os
import platform
import sys

from . import __version__, _device, _lib

MAX_RELERR = 1e-2   # DESIGN.md section 2, as the tests hold the layer to


def _library_facts() -> dict:
    path = _lib.library_path()
    found_by = (f"${_lib.ENV_VAR}" if os.environ.get(_lib.ENV_VAR) else
                "the checkout's build" if path == _lib.CHECKOUT_PATH else "the wheel's copy")
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


# (E, H, I, top_k, activation, tokens): the decode path's one launch (M = 3) and the four launches (M = 300)
RUN_CASES = ((8, 512, 256, 2, "silu", 3), (32, 1024, 512, 4, "swiglu_oai", 300))


def run_check(device: int = 0, seed: int = 0) -> list:
    """fused_moe against the reference on fresh random inputs (every 32 weights their own scale), the output poisoned
    with NaN before each call; once eager, once replayed from a CUDA graph on new inputs. One row per case and mode."""
    import torch

    from . import layer, mxfp4, reference
    from .experts import prepare_experts

    dev = torch.device("cuda", device)
    gen = torch.Generator(dev).manual_seed(seed)
    rows = []
    for E, H, I, k, activation, M in RUN_CASES:
        def weights(N, K):
            return (torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen),
                    torch.randint(116, 128, (E, N, K // mxfp4.BLOCK), dtype=torch.uint8, device=dev, generator=gen))

        def inputs():
            ids = torch.rand(M, E, device=dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
            return (torch.randn(M, H, device=dev, generator=gen).to(torch.bfloat16),
                    torch.rand(M, k, device=dev, generator=gen).softmax(dim=1), ids)

        experts = prepare_experts(*weights(2 * I, H), *weights(H, I))
        options = dict(activation=activation, swiglu_limit=7.0 if activation == "swiglu_oai" else None)
        x, w, ids = inputs()
        out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream(dev)   # eager on the stream the graph captures on: its workspace exists by then
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            layer.fused_moe(x, experts, w, ids, out=out, **options)
        side.synchronize()
        checks = [("eager", out.clone(), (x.clone(), w.clone(), ids.clone()))]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            layer.fused_moe(x, experts, w, ids, out=out, **options)
        for buffer, new in zip((x, w, ids), inputs()):
            buffer.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        checks.append(("graph", out.clone(), (x.clone(), w.clone(), ids.clone())))
        for mode, got, (x_, w_, ids_) in checks:
            ref = reference.fused_moe(x_, experts, w_, ids_, **options).float()
            err = ((got.float() - ref).norm() / ref.norm()).item()   # NaN where a row was never written
            rows.append({"E": E, "H": H, "I": I, "top_k": k, "activation": activation, "M": M, "mode": mode,
                         "relerr": err, "ok": err < MAX_RELERR})
    torch.cuda.synchronize(dev)
    return rows


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
    out += [f"  ran E={c['E']} H={c['H']} I={c['I']} k={c['top_k']} {c['activation']} M={c['M']} {c['mode']}: relative "
            f"error {c['relerr']:.1e} against the reference" + ("" if c["ok"] else " (FAILED)") for c in r.get("run", [])]
    out.append("ready: fused_moe can run here" if r["ready"] else "not ready:")
    out += [f"  {p}" for p in r["problems"]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_cutlass", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON (for a bug report)")
    p.add_argument("--run", action="store_true",
                   help="where ready, also run the layer on small random inputs against the reference (seconds)")
    args = p.parse_args(argv)
    r = report()
    if args.run and r["ready"]:
        index = next(d["index"] for d in r["gpu"]["devices"] if d["sm90"])
        try:
            r["run"] = run_check(index)
            failed = [c for c in r["run"] if not c["ok"]]
            problem = (f"run: {len(failed)} of {len(r['run'])} checks differ from the reference (worst relative "
                       f"error {max(c['relerr'] for c in failed):.2e})") if failed else None
        except Exception as exc:   # a kernel that cannot run here is the answer, not a crash of the report
            problem = f"run: {type(exc).__name__}: {exc}"
        if problem:
            r["problems"].append(problem)
            r["ready"] = False
    print(json.dumps(r, indent=2) if args.json else "\n".join(_lines(r)))
    return 0 if r["ready"] else 1


if __name__ == "__main__":
    sys.exit(main())
