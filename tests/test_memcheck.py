"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the layer's kernels.

The GPU tests run benchmarks/sanitize.py's workload under the four tools at once and need each
clean of device-side errors in our kernels; the CPU tests pin how a report is read, so that a
dependency's API probing (cuGetProcAddress on a fresh cuda-python) cannot fail them and an error
in our kernels cannot pass them.
"""
import pytest

from benchmarks import sanitize
from benchmarks.sanitize import parse_report

BANNER = "========= COMPUTE-SANITIZER\n"
DONE = sanitize.DONE + " 10 configs\n"

PROBES = "".join(
    "========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to \"invalid argument\" on CUDA API call to "
    "cuGetProcAddress_v2.\n"
    "=========     Saved host backtrace up to driver entry point at error\n"
    "=========         Host Frame: cuGetProcAddress_v2 [0x2f3a1] in libcuda.so.1\n"
    "=========         Host Frame: at::cuda::detail::lazyInitCUDA() [0x11] in libtorch_cuda.so\n"
    "=========\n" for _ in range(41))

OUR_READ = (
    "========= Invalid __global__ read of size 16 bytes\n"
    "=========     at void routing::expand_gather_kernel<int>(routing::ExpandArgs<int>)+0x1f0 in routing.cuh:335\n"
    "=========     by thread (3,0,0) in block (7,0,0)\n"
    "=========     Address 0x7f0000001000 is out of bounds\n"
    "=========     Saved host backtrace up to driver entry point at kernel launch time\n"
    "=========         Host Frame: at::native::foo() [0x1] in libtorch_cpu.so\n"
    "=========\n")

TORCH_READ = (
    "========= Uninitialized __global__ memory read of size 4 bytes\n"
    "=========     at void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)+0x90\n"
    "=========     by thread (0,0,0) in block (0,0,0)\n"
    "=========\n")

OLD_FORMAT = (  # older tools put the offset first and the function after the file
    "========= Barrier error detected. Divergent thread(s) in warp.\n"
    "=========     at 0x3a0 in /src/moe_gemm_mainloop.hpp:210:cutlass::device_kernel<MoeGemm>(Params)\n"
    "=========     by thread (33,0,0) in block (0,0,0)\n"
    "=========\n")


def test_api_probing_of_a_dependency_is_not_our_error():
    # The fresh-install report of issue 10: 41 failed cuGetProcAddress_v2 calls, no device finding.
    result = parse_report("memcheck", BANNER + PROBES + DONE + "========= ERROR SUMMARY: 41 errors\n")
    assert (result.errors, result.api_errors) == (0, 41) and result.clean
    command = sanitize.command("compute-sanitizer", "memcheck")
    assert command[command.index("--report-api-errors") + 1] == "no"


def test_api_reports_do_not_hide_a_device_error():
    result = parse_report("memcheck", BANNER + PROBES + OUR_READ + DONE + "========= ERROR SUMMARY: 42 errors\n")
    assert result.errors == 1 and not result.clean


def test_an_error_in_our_kernel_counts():
    result = parse_report("memcheck", BANNER + OUR_READ + DONE + "========= ERROR SUMMARY: 1 error\n")
    assert result.errors == 1 and not result.clean
    assert "expand_gather_kernel" in result.reports[0]


def test_an_error_in_torchs_kernel_is_reported_apart():
    log = BANNER + TORCH_READ + OUR_READ + DONE + "========= ERROR SUMMARY: 2 errors\n"
    result = parse_report("initcheck", log)
    assert (result.errors, result.torch_errors) == (1, 1)
    only_torch = parse_report("initcheck", BANNER + TORCH_READ + DONE + "========= ERROR SUMMARY: 1 error\n")
    assert (only_torch.errors, only_torch.torch_errors) == (0, 1) and only_torch.clean


def test_the_older_report_format_counts_too():
    result = parse_report("synccheck", BANNER + OLD_FORMAT + DONE + "========= ERROR SUMMARY: 1 error\n")
    assert result.errors == 1 and "moe_gemm_mainloop" in result.reports[0]


def test_errors_the_parser_cannot_place_still_count():
    result = parse_report("memcheck", BANNER + DONE + "========= ERROR SUMMARY: 3 errors\n")
    assert result.errors == 3


def test_racecheck_counts_errors_and_keeps_warnings_apart():
    log = (BANNER + "========= Warning: Race reported between Write access at kernel+0x10 and Write access\n"
           + DONE + "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n")
    result = parse_report("racecheck", log)
    assert (result.errors, result.warnings) == (0, 1) and result.clean
    log = (BANNER + "========= Error: Race reported between Write access at moe_gemm+0x10 and Read access\n"
           + DONE + "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert parse_report("racecheck", log).errors == 1


def test_a_crash_or_an_unfinished_workload_is_not_clean():
    crashed = parse_report("memcheck", BANNER + "Segmentation fault\n")
    assert crashed.errors == -1 and not crashed.clean
    unfinished = parse_report("memcheck", BANNER + "========= ERROR SUMMARY: 0 errors\n")
    assert unfinished.errors == 0 and not unfinished.clean


@pytest.fixture(scope="module")
def tool_results():
    sanitizer = sanitize.find_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    return {r.tool: r for r in sanitize.run_tools(sanitizer=sanitizer)}


@pytest.mark.gpu
@pytest.mark.parametrize("tool", sanitize.TOOLS)
def test_kernels_are_sanitizer_clean(tool_results, tool):
    result = tool_results[tool]
    details = "\n\n".join(result.reports)
    assert result.workload_done, f"{tool}: the workload did not finish (exit {result.exit_code})\n{details}"
    assert result.errors == 0, f"{tool}: {result.summary}\n{details}"
