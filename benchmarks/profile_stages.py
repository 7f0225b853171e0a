"""Where one layer's time goes: device time of every kernel of a fused_moe call (torch.profiler).

usage: python -m benchmarks.profile_stages [--configs a,b] [--ms 1,64,4096] [--reps 20] [--out-dir DIR]
Writes a "profile" record: per config and M, the mean device microseconds of each kernel name.
"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import moe_cutlass as mc
from benchmarks.bench_moe import CONFIGS, random_mxfp4, random_routing
from benchmarks.record import write_record


def kernel_times(fn, reps):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default="1,16,256,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in args.configs.split(","):
        E, H, I, k = CONFIGS[name]
        experts = mc.prepare_experts(*random_mxfp4(E, 2 * I, H, gen), *random_mxfp4(E, H, I, gen))
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, H, dtype=torch.bfloat16, device="cuda", generator=gen)
            weights, ids = random_routing(M, E, k, gen)
            times = kernel_times(lambda: mc.fused_moe(x, experts, weights, ids), args.reps)
            rows.append({"config": name, "M": M, "kernels_us": times})
            print(f"{name} M={M}: total {sum(times.values()):.1f} us")
            for kernel, us in times.items():
                print(f"    {us:9.1f} us  {kernel}")
        del experts
        torch.cuda.empty_cache()
    write_record("profile", {"rows": rows}, args.out_dir)


if __name__ == "__main__":
    main()
