"""compute-sanitizer's memcheck, racecheck, synccheck and initcheck over the layer's kernels.

usage: python -m benchmarks.sanitize [--tools memcheck,racecheck,synccheck,initcheck] [--out-dir DIR]
       python -m benchmarks.sanitize --workload      (what each tool runs; needs an SM90 GPU)

The workload is small: fused_moe through both expand paths (<= 16384 slots, and the multi-kernel
one past it), int32 and int64 ids with invalid ones and an expert map, H = I = 96 (not tile
multiples); then one GEMM1 and one GEMM2 launch per tile config the library holds. The tools run
side by side, one process each, with the caching allocator off so that every tensor is its own
allocation (an access past one is caught, fresh memory is uninitialized).

Every tool runs with --report-api-errors no. A driver call that returns an error is the caller's
business: cuda-python probes driver entry points with cuGetProcAddress when it loads, which a
fresh install (cuda-python 13.4.4, driver 580) reports as 41 CUDA_ERROR_INVALID_VALUE "errors",
and our own calls are checked where they are made (the workload raises and never prints its
last line). What counts is what the tools find on the device: out-of-bounds and misaligned
accesses, shared-memory races, barrier misuse, reads of uninitialized global memory, in any
kernel but torch's own. Writes a "sanitizer" record; exits 1 when a tool found such an error,
crashed, or the workload did not finish.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
DONE = "sanitizer workload done"
REPO = Path(__file__).resolve().parent.parent
PREFIX = "========= "
TORCH_NAMESPACES = ("at::", "c10::")  # device code that is torch's, not ours
NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
                "Target application returned an error")
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def workload():
    """Runs under each tool: every kernel of the layer once or more, on small shapes."""
    import torch

    import moe_cutlass as mc
    from moe_cutlass import _gemm, _lib, ops
    from tests.helpers import random_experts, random_hidden, random_routing

    gen = torch.Generator("cuda").manual_seed(0)
    E, H, I, k = 6, 96, 96, 3  # noqa: E741
    experts = random_experts(E, H, I, gen, bias=True, gate_up="interleaved")

    M = 37  # 111 slots: the one-kernel expand
    weights, ids = random_routing(M, E, k, gen)
    ids[::4, 0] = -1
    ids[1::4, 1] = E + 3
    out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    mc.fused_moe(random_hidden(M, H, gen), experts, weights, ids, activation="swiglu_oai", swiglu_limit=7.0,
                 out=out)

    M = 5500  # 16500 slots: count, scatter and gather kernels
    expert_map = torch.tensor([3, -1, 0, 5, 1, -1, 2, 4], dtype=torch.int32, device="cuda")
    weights, ids = random_routing(M, expert_map.numel(), k, gen)
    ids[::5, 2] = -7
    mc.fused_moe(random_hidden(M, H, gen), experts, weights, ids.long(), expert_map=expert_map)

    # The one-launch layer (templates/sm90/moe_decode.cuh): one token (the default path), then 20
    # and 40 rows on one expert (token groups of up to 8 rows) with the thresholds lifted, on each
    # kernel (ring): up to 32 slots one warp routes them, above the shared-memory routing does.
    weights, ids = random_routing(1, E, k, gen)
    mc.fused_moe(random_hidden(1, H, gen), experts, weights, ids)
    fused_rule = ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS, ops.fused_kernel
    ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS = 64, 1 << 62
    try:
        for kernel in ops.FUSED_KERNELS:
            ops.fused_kernel = lambda *shape, kernel=kernel: kernel
            for rows in (20, 40):
                weights, ids = random_routing(rows, E, 1, gen)
                mc.fused_moe(random_hidden(rows, H, gen), experts, weights, torch.full_like(ids, 2))
    finally:
        ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS, ops.fused_kernel = fused_rule

    # One launch of each GEMM config; experts of 5, 0 and 11 rows, GEMM1's rows feed GEMM2.
    experts = random_experts(3, H, I, gen, bias=True)
    offsets = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device="cuda")
    rows = random_hidden(16, H, gen)
    inter = torch.empty(16, I, dtype=torch.bfloat16, device="cuda")
    down = torch.empty(16, H, dtype=torch.bfloat16, device="cuda")
    row_weights = torch.rand(16, device="cuda", generator=gen)
    configs = sorted(_lib.library().kernels)
    for config in (c for c in configs if c.startswith("moe_gemm1_")):
        _gemm.run(config, experts.w13, rows, offsets, inter, 2 * I, H, swiglu_limit=10.0)
    for config in (c for c in configs if c.startswith("moe_gemm2_")):
        _gemm.run(config, experts.w2, inter, offsets, down, H, I, row_weights=row_weights)
    torch.cuda.synchronize()
    print(DONE, len(configs), "configs")


@dataclass
class ToolResult:
    tool: str
    errors: int  # device-side errors outside torch's kernels; -1 when the report has no summary
    torch_errors: int = 0
    api_errors: int = 0  # failed API calls the tool reported: not counted
    warnings: int = 0  # racecheck's hazards it judges benign
    summary: str = ""
    exit_code: int = 0
    workload_done: bool = False
    seconds: float = 0.0
    reports: list = field(default_factory=list)  # the first few findings, as printed

    @property
    def clean(self):
        return self.errors == 0 and self.workload_done


def _reports(log):
    """The tool's reports as lists of lines (header first), without the banner and summaries."""
    blocks = []
    for line in log.splitlines():
        if not line.startswith(PREFIX.rstrip()):
            continue
        text = line[len(PREFIX):] if line.startswith(PREFIX) else ""
        if text and not text[0].isspace():
            blocks.append([text])
        elif blocks and text.strip():
            blocks[-1].append(text.strip())
    return [b for b in blocks if not b[0].startswith(NOT_FINDINGS)]


def _is_api_error(block):
    return block[0].startswith("Program hit")


def _in_torch(block):
    # The first "at" line names the device function; later lines are host backtraces.
    where = next((line for line in block[1:] if line.startswith("at ")), "")
    return any(ns in where for ns in TORCH_NAMESPACES)


def parse_report(tool, log):
    """Count what a compute-sanitizer log found: a ToolResult without timing or exit code."""
    reports = _reports(log)
    api_errors = sum(map(_is_api_error, reports))
    found = [b for b in reports if not _is_api_error(b) and not b[0].startswith("Warning")]
    torch_errors = sum(_in_torch(b) for b in found)
    warnings = 0
    race = RACE_SUMMARY.search(log)
    summary = ERROR_SUMMARY.search(log)
    if tool == "racecheck" and race:
        total, warnings, line = int(race.group(2)), int(race.group(3)), race.group(0)
    elif summary:
        total, line = int(summary.group(1)), summary.group(0)
    else:
        return ToolResult(tool, -1, summary="no summary in the report", workload_done=DONE in log)
    # Counted down from the summary, so a report this parser misreads counts as ours. API reports
    # (should a tool print them despite --report-api-errors no) are not device findings.
    return ToolResult(tool, max(0, total - api_errors - torch_errors), torch_errors=torch_errors,
                      api_errors=api_errors, warnings=warnings,
                      summary=line, workload_done=DONE in log,
                      reports=["\n".join(b[:8]) for b in found if not _in_torch(b)][:5])


def find_sanitizer():
    for path in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if path and os.access(path, os.X_OK):
            return path
    return None


def command(sanitizer, tool):
    return [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "3",
            sys.executable, "-m", "benchmarks.sanitize", "--workload"]


def run_tool(sanitizer, tool, timeout=300):
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    try:
        proc = subprocess.run(command(sanitizer, tool), capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=REPO)
        log, exit_code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        log, exit_code = log + f"\ntimed out after {timeout} s", -1
    result = parse_report(tool, log)
    result.exit_code, result.seconds = exit_code, round(time.monotonic() - started, 1)
    if not result.clean:
        result.reports.append(log[-3000:])
    return result


def run_tools(tools=TOOLS, timeout=300, sanitizer=None):
    """Each tool over the workload, all at once (separate processes share the GPU)."""
    sanitizer = sanitizer or find_sanitizer()
    if sanitizer is None:
        raise FileNotFoundError("compute-sanitizer not found (PATH, /usr/local/cuda/bin)")
    with ThreadPoolExecutor(len(tools)) as pool:
        return list(pool.map(lambda tool: run_tool(sanitizer, tool, timeout), tools))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="store_true", help="run the workload itself (under a tool)")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per tool")
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.workload:
        workload()
        return 0
    from benchmarks.record import write_record

    sanitizer = find_sanitizer()
    started = time.monotonic()
    results = run_tools(args.tools.split(","), args.timeout, sanitizer)
    for r in results:
        print(f"{r.tool:10s} errors {r.errors:3d} (torch's {r.torch_errors}, warnings {r.warnings}) "
              f"workload {'done' if r.workload_done else 'NOT DONE'}  {r.seconds:.0f} s  {r.summary}")
        for report in r.reports:
            print(report)
    version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip()
    path = write_record("sanitizer", {
        "errors": {r.tool: r.errors for r in results},
        "clean": all(r.clean for r in results),
        "options": command("compute-sanitizer", "TOOL")[1:6],
        "sanitizer_version": version.splitlines()[-1] if version else "",
        "seconds": round(time.monotonic() - started, 1),
        "tools": [asdict(r) for r in results],
    }, args.out_dir)
    print(f"record: {path}")
    return 0 if all(r.clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
