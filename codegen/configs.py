"""The kernel table: which instantiations exist, per architecture. Data only.

A GEMM tile is one entry of SM90_GEMM_TILES (built for GEMM1 and GEMM2). Another kernel family
is one KernelConfig in KERNELS[arch]: its template `templates/<arch>/<family>.cu.j2` is
rendered with `name` and every entry of `params` as top-level variables; the optional
`templates/<arch>/<family>.h.j2`, rendered with the same variables, declares the extern "C"
functions the instantiation exports (plain C prototypes with named parameters; symbols must
differ per config, so they embed {{ name }}; functions returning int return a cudaError_t and
take the stream last).
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

# MXFP4 x BF16 MoE grouped GEMM tiles (templates/sm90/moe_gemm*), weight rows x tokens x K, all
# cooperative (2 consumer warpgroups on one 128-row tile); each is built for kind 1 = GEMM1
# (gate/up + activation, half-width output) and kind 2 = GEMM2 (down, row weight). Which one runs
# for how many rows per expert: moe_cutlass/_gemm.pick_config. H200 measurements
# (benchmarks/results/bench_20261129T124329Z_gemm.json, bench_20261129T131109Z_gemm.json): 128x16x128
# and 64x16 pingpong lost everywhere and were dropped; 128x64x128 wins at 33..64 rows per expert,
# where 128x32 needs two tiles and 128x128 pads half of one. 128x96x128 serves the split plans
# (_gemm.split_plan): an expert's remainder of 65..96 rows in one tile instead of a 128-row one.
# A/B'd and dropped (bench_20261201T015430Z, M = 1024..16384, all four shapes): 64x128x128
# pingpong 10-50% slower than 128x128x128 cooperative (even at qwen3's K = 768), 128x128x64
# 1-13% slower (gpt-oss's K = 2880 pads to 2944 with TileK 128, but the extra k iterations cost more).
# 192-row tiles: three consumer warpgroups (templates/sm90/moe_gemm_kernel.hpp), TileK 128 (152
# registers per consumer thread): autotune candidates since the TileK 256 versions below took their place in the
# rule (moe_cutlass/_gemm.py TALL_TILES; benchmarks/NOTES.md 2026-12-04 (41)), as are the 16-token tiles.
# 192x8x256: the 8-token tile with TileK 256 on three consumer warpgroups, its A register sets holding
# half a k tile each (moe_gemm_mainloop.hpp, 10.); _gemm.plan streams every call of up to 4 rows per expert on it.
# 192x16x256 measured a tie with 128x16x256 (M = 256, all four shapes) and is not built.
# 192x96x128 / 192x128x128 (half-tile register sets too): GEMM1's prefill parts (_gemm.TALL_TILES_GEMM1).
# 128x48x256 / 192x48x128 (a 48-token split part) measured no gain twice and are not built
# (benchmarks/NOTES.md 2026-12-01 (11) and (15)). 192x32x256 / 192x64x256 (half sets): the split plan's 32/64-token
# parts at any K (gpt-oss's K = 2880 pads to 3072 and still gains), and the 32-token one streams 4-12 rows per expert.
# A/B'd and dropped (benchmarks/results/raw/profile_20261201T0543*Z_libe_*coop2.json): 128x8x128 and
# 128x16x128 with two CTAs per SM (four consumer warps per scheduler, 104 registers each) against
# 128x8x256 / 128x16x256: gpt-oss M = 4 GEMM1 -15%, M = 64 -4%, but M = 16 +6%, dsv3 +10..+18%,
# qwen3 M = 4 GEMM1 +20%.
# A fourth number is a cluster of that many CTAs along the weight rows (name suffix _c2): the CTAs
# of a cluster take consecutive weight-row tiles of one token tile and each loads a share of the
# tokens for all (TMA multicast; moe_gemm_mainloop.hpp 11.): the 128-token split part of both GEMMs
# (GEMM1 on 192 rows) from _gemm.CLUSTER_MIN_ROWS rows per expert. Measured and not built
# (benchmarks/NOTES.md 2026-12-01 (17)): a 256-token split part, 128x256x64 (GEMM2 spilled 228 bytes):
# per GEMM +10..+14% (+18..+26% in clusters) where 94-300 rows per expert put a 129-255-row remainder
# in one 256-token tile (qwen3 M = 2048, gpt-oss and dsv3 M = 4096), -3.5..+5.7% at M = 16384;
# 128x256x128 made ptxas serialize the GMMAs (C7520) and ran 30x slower.
# 128x160x128 (0 spill bytes): the 160-token part of _gemm.WIDE_TILE, an expert's 129-160 rows in one tile
# (gpt-oss / dsv3 M = 4096 layers -13 / -9%, benchmarks/NOTES.md 2026-12-02 (28)).
SM90_GEMM_TILES = ((128, 32, 128), (128, 64, 128), (128, 96, 128), (128, 128, 128), (128, 16, 256), (128, 8, 256),
                   (128, 32, 256), (128, 64, 256), (192, 8, 128), (192, 16, 128), (192, 32, 128), (192, 64, 128),
                   (192, 8, 256), (192, 96, 128), (192, 128, 128), (192, 32, 256), (192, 64, 256),
                   (128, 160, 128), (128, 128, 128, 2), (192, 128, 128, 2))


def _gemm_configs(tiles) -> list:
    return [KernelConfig(f"moe_gemm{kind}_m{m}n{n}k{k}_coop" + (f"_c{c[0]}" if c else ""), "moe_gemm.cu.j2",
                         {"kind": kind, "tile_m": m, "tile_n": n, "tile_k": k, "pingpong": False,
                          "cluster_m": c[0] if c else 1})
            for m, n, k, *c in tiles for kind in (1, 2)]


# The one-launch layer (templates/sm90/moe_decode.cuh), one kernel per shared-memory ring: stages of
# chunk_units 64-K units (K 512 or 1024 per stage). moe_cutlass.ops.fused_kernel picks per call.
SM90_DECODE_RINGS = ((8, 7), (16, 4))


def _decode_configs(rings) -> list:
    return [KernelConfig(f"moe_decode_k{64 * units}", "moe_decode.cu.j2", {"chunk_units": units, "stages": stages})
            for units, stages in rings]


KERNELS = {
    "sm90": [KernelConfig("routing", "routing.cu.j2"), *_decode_configs(SM90_DECODE_RINGS),
             *_gemm_configs(SM90_GEMM_TILES)],
}
