"""The kernel table: which instantiations exist, per architecture. Data only.

Adding a kernel = appending one KernelConfig to KERNELS[arch]. Its template
`templates/<arch>/<family>.cu.j2` is rendered with `name` and every entry of `params`
as top-level variables; the optional `templates/<arch>/<family>.h.j2`, rendered with the
same variables, declares the extern "C" functions the instantiation exports (plain C
prototypes with named parameters; symbols must differ per config, so they embed
{{ name }}; functions returning int return a cudaError_t and take the stream last).

Example entry (the GEMM family):
    KernelConfig("gemm1_m64n32_pingpong", "moe_gemm.cu.j2",
                 {"tile_m": 64, "tile_n": 32, "tile_k": 64, "schedule": "pingpong", "epilogue": "swiglu"})
"""

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class KernelConfig:
    name: str  # unique per arch; becomes the source file name <name>.cu
    template: str  # file name under templates/<arch>/, ending in ".cu.j2"
    params: Mapping[str, Any] = field(default_factory=dict)  # JSON-serializable template variables

    def __post_init__(self):
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))


# Flags that select the architecture; the rest of the nvcc command line is in build.py.
ARCH_FLAGS = {
    "sm90": ("-gencode=arch=compute_90a,code=sm_90a",),
}

KERNELS = {
    "sm90": [
        KernelConfig("routing", "routing.cu.j2"),
        # MXFP4 x BF16 MoE grouped GEMMs (templates/sm90/moe_gemm*): kind 1 = GEMM1 (gate/up +
        # activation, half-width output), kind 2 = GEMM2 (down, row weight); tile = weight rows x
        # tokens x K; cooperative = 2 consumer warpgroups on one 128-row tile. Which one to use
        # for how many rows per expert: moe_cutlass/_gemm.pick_config (H200 measurements in
        # benchmarks/results/bench_20261129T124329Z_gemm.json and bench_20261129T131109Z_gemm.json;
        # 128x16x128 and 64x16 pingpong lost everywhere and were dropped; 128x64x128 wins at
        # 33..64 rows per expert, where 128x32 needs two tiles and 128x128 pads half of one).
        KernelConfig("moe_gemm1_m128n32k128_coop", "moe_gemm.cu.j2",
                     {"kind": 1, "tile_m": 128, "tile_n": 32, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm2_m128n32k128_coop", "moe_gemm.cu.j2",
                     {"kind": 2, "tile_m": 128, "tile_n": 32, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm1_m128n64k128_coop", "moe_gemm.cu.j2",
                     {"kind": 1, "tile_m": 128, "tile_n": 64, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm2_m128n64k128_coop", "moe_gemm.cu.j2",
                     {"kind": 2, "tile_m": 128, "tile_n": 64, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm1_m128n128k128_coop", "moe_gemm.cu.j2",
                     {"kind": 1, "tile_m": 128, "tile_n": 128, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm2_m128n128k128_coop", "moe_gemm.cu.j2",
                     {"kind": 2, "tile_m": 128, "tile_n": 128, "tile_k": 128, "pingpong": False}),
        KernelConfig("moe_gemm1_m128n16k256_coop", "moe_gemm.cu.j2",
                     {"kind": 1, "tile_m": 128, "tile_n": 16, "tile_k": 256, "pingpong": False}),
        KernelConfig("moe_gemm2_m128n16k256_coop", "moe_gemm.cu.j2",
                     {"kind": 2, "tile_m": 128, "tile_n": 16, "tile_k": 256, "pingpong": False}),
        KernelConfig("moe_gemm1_m128n8k256_coop", "moe_gemm.cu.j2",
                     {"kind": 1, "tile_m": 128, "tile_n": 8, "tile_k": 256, "pingpong": False}),
        KernelConfig("moe_gemm2_m128n8k256_coop", "moe_gemm.cu.j2",
                     {"kind": 2, "tile_m": 128, "tile_n": 8, "tile_k": 256, "pingpong": False}),
    ],
}
