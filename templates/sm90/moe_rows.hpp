// moe_cutlass: which of an expert's rows one grouped-GEMM launch takes (issue 8, "128 + remainder").
//
// Why: one token tile per launch, picked on the host from the average rows per expert, either pads
// the MMA work (a nearly empty second 128-token tile for half the experts at M = 4096: 1.24-1.50x
// the useful work, benchmarks/NOTES.md tile waste) or makes the busier experts stream and convert
// their weights twice (the M = 1024 ridge). Only the device knows each expert's rows, so a layer
// call launches each GEMM as up to three parts with token tiles of decreasing size, and each part
// takes, of every expert's r rows, a window decided here from r alone:
//   the remainder r % chunk when rem_lo < r % chunk <= rem_hi,
//   the full chunks (r - r % chunk rows) too when rem_hi == chunk (the largest part),
// so every row lands in exactly one part, each expert's remainder in the smallest tile that holds
// it, and each weight tile is converted once per part that holds rows of its expert. One window
// (chunk, 0, chunk) takes every row: a single-part launch.
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"

namespace moe_cutlass {

struct MoeRowWindow {
  int32_t chunk_log2 = 30;   // chunk = 2^chunk_log2 rows
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
    int32_t const chunk = int32_t(1) << chunk_log2;
    int32_t const rem = r & (chunk - 1);
    bool const full = rem_hi == chunk;
    int32_t const take_rem = (rem > rem_lo && rem <= rem_hi) ? rem : 0;
    first = full ? lo : lo + (r - rem);
    count = (full ? r - rem : 0) + take_rem;
  }

  // A window the host may pass: chunk a power of two up to 2^30, 0 <= rem_lo < rem_hi <= chunk.
  static bool valid(int32_t chunk, int32_t lo, int32_t hi) {
    return chunk > 0 && chunk <= (1 << 30) && (chunk & (chunk - 1)) == 0 && lo >= 0 && lo < hi && hi <= chunk;
  }
  static MoeRowWindow make(int32_t chunk, int32_t lo, int32_t hi) {
    MoeRowWindow w;
    w.chunk_log2 = 0;
    while ((int32_t(1) << w.chunk_log2) < chunk) ++w.chunk_log2;
    w.rem_lo = lo;
    w.rem_hi = hi;
    return w;
  }
};

}  // namespace moe_cutlass
