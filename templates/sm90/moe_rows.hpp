// moe_cutlass: which of an expert's rows one grouped-GEMM launch takes (issue 8, "128 + remainder").
//
// Why: one token tile per launch, picked on the host from the average rows per expert, either pads
// the MMA work (a nearly empty second 128-token tile for half the experts at M = 4096: 1.24-1.50x
// the useful work, benchmarks/NOTES.md tile waste) or makes the busier experts stream and convert
// their weights twice (the M = 1024 ridge). Only the device knows each expert's rows, so a layer
// call launches each GEMM as up to five parts (MC_MAX_GEMM_PARTS) with token tiles of decreasing size, and each part
// takes, of every expert's r rows, a window decided here from r alone:
//   the remainder r % chunk when rem_lo < r % chunk <= rem_hi,
//   the full chunks (r - r % chunk rows) too when rem_hi == chunk (the largest part),
// so every row lands in exactly one part, each expert's remainder in the smallest tile that holds
// it, and each weight tile is converted once per part that holds rows of its expert. One window
// (chunk, 0, chunk) takes every row: a single-part launch.
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/fast_math.h"

namespace moe_cutlass {

struct MoeRowWindow {
  // Any chunk, not only powers of two: the 160-token part's chunk of 160 rows (_gemm.split_plan) keeps an
  // expert of 208-304 rows (qwen3 at M = 4096) in two tiles where 128-row chunks need three. The remainder
  // by the host's multiply-shift (CUTLASS FastDivmod's, for r < 2^31: IMAD.HI, SHF, IMAD), never a
  // division: the tile scheduler walks every expert through here (moe_gemm_launch.hpp, MoeProblemShape).
  // Without FastDivmod's divisor-1 case: its test made the multiplier's and shift's loads predicated and
  // dependent on the divisor's, and cost the 16-token tile's single launches 3-4% at M = 256 against a mask
  // (benchmarks/NOTES.md 2026-12-02 (28)); a chunk of 1 (every row in full chunks) is the window of 2^30.
  int32_t chunk = 1 << 30;
  uint32_t multiplier = 1u << 31;
  uint32_t shift = 29;
  int32_t rem_lo = 0;
  int32_t rem_hi = 1 << 30;

  // This launch's rows of the expert whose rows are [lo, hi) of the act buffer: [first, first + count).
  // Malformed offsets (negative, decreasing) give no rows: the expert is skipped.
  CUTLASS_HOST_DEVICE void rows(int32_t lo, int32_t hi, int32_t& first, int32_t& count) const {
    if (lo < 0 || hi < lo) {
      first = lo;
      count = 0;
      return;
    }
    int32_t const r = hi - lo;
#if defined(__CUDA_ARCH__)
    int32_t const quotient = int32_t(__umulhi(uint32_t(r), multiplier) >> shift);
#else
    int32_t const quotient = int32_t(((uint64_t(uint32_t(r)) * multiplier) >> 32) >> shift);
#endif
    int32_t const rem = r - quotient * chunk;
    bool const full = rem_hi == chunk;
    int32_t const take_rem = (rem > rem_lo && rem <= rem_hi) ? rem : 0;
    first = full ? lo : lo + (r - rem);
    count = (full ? r - rem : 0) + take_rem;
  }

  // A window the host may pass: 0 < chunk <= 2^30, 0 <= rem_lo < rem_hi <= chunk.
  static bool valid(int32_t chunk, int32_t lo, int32_t hi) {
    return chunk > 0 && chunk <= (1 << 30) && lo >= 0 && lo < hi && hi <= chunk;
  }
  static MoeRowWindow make(int32_t chunk, int32_t lo, int32_t hi) {
    MoeRowWindow w;   // (1, 0, 1), the only window of chunk 1, takes every row: the default's
    if (chunk > 1) {
      w.chunk = chunk;
      cutlass::find_divisor(w.multiplier, w.shift, unsigned(chunk));
      w.rem_lo = lo;
      w.rem_hi = hi;
    }
    return w;
  }
};

}  // namespace moe_cutlass
