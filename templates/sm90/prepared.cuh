// moe_cutlass: the prepared weight layout's geometry (moe_cutlass/layout.py) and the device facts
// that more than one launcher needs, in one place.
#pragma once

#include <cuda_runtime.h>

namespace moe_cutlass {

constexpr int kRowPad = 128;        // weight rows padded to a multiple of this (Npad)
constexpr int kKPad = 64;           // K padded to a multiple of this (Kp)
constexpr int kSlabRows = 64;       // a slab: 64 weight rows, contiguous over K
constexpr int kUnitBytes = 2048;    // a 64-row x 64-K unit; a slab is Kp / 64 of them

// SMs of the current device, cached for the last device asked about; -1 on error.
inline int device_sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  static int cached_dev = -1, cached_sms = -1;   // benign race: both writers store the same value
  if (dev == cached_dev && cached_sms > 0) return cached_sms;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
  cached_sms = sms;
  cached_dev = dev;
  return sms;
}

}  // namespace moe_cutlass
