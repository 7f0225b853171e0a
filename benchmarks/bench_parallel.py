"""One GPU against two: expert parallel (each strategy) and tensor parallel, on the DESIGN.md section 5
shapes. Run on two GPUs:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_parallel [--configs a,b] [--ms 1,16,...]
             [--out-dir DIR]

What M means per implementation (rows also carry "tokens", what one layer call serves):
- one_gpu: M tokens through fused_moe on one GPU (each rank times its own, alone on its GPU);
- ep_allgather, ep_alltoall, ep_alltoall_padded: M tokens on EACH rank (data-parallel attention in
  front), so the pair serves 2M; max_tokens = M;
- tp: the same M tokens on both ranks; the pair serves M.

us: time per layer call, the median of CUDA events over the reps with the L2 flushed before each
(bench_moe.Timer), as CUDA-graph replay ("graph") except ep_alltoall, which reads its counts on the host
and runs eagerly ("eager"); the slower rank's median. comm_us: the same forward timed the same way with
the experts' computation left out (its output left uninitialized), so what remains is the collectives
and the bookkeeping around them (packing, finalize); comm_share = comm_us / us. floor_us: the one-GPU
floor (bench_moe.floor_us) of the tokens the call serves, halved for two GPUs (each reads half the
active experts' weights and does half the FLOPs); x_floor = us / floor_us.
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist

import moe_cutlass as mc
from benchmarks.bench_moe import CONFIGS, Timer, floor_us, graph_of, measure_floors, random_batch, random_experts
from benchmarks.record import write_record
from moe_cutlass import parallel as par

TOKENS = [1, 16, 256, 4096, 16384]
EP_STRATEGIES = {"ep_allgather": "allgather", "ep_alltoall": "alltoall", "ep_alltoall_padded": "alltoall_padded"}


def reps_for(M, reps):
    """(reps, warm-up calls): fewer where one call takes milliseconds (the whole run stays within minutes)."""
    return (reps, 10) if M <= 256 else (max(10, reps // 5), 3) if M <= 4096 else (10, 3)


def without_experts(forward, hidden_size):
    """forward with the experts' computation replaced by an uninitialized output."""
    stub = copy.copy(forward)
    stub._compute = lambda x, w, ids, out=None: x.new_empty(x.shape[0], hidden_size) if out is None else out
    return stub


def slowest(us):
    """The largest of the ranks' values (the layer is as slow as its slowest rank)."""
    t = torch.tensor([us], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_call(timer, fn, capturable, reps):
    """(us, mode) of fn, the slower rank's: graph replay where capturable, else eager."""
    timer.reps, warmup = reps
    dist.barrier()
    if not capturable:
        return slowest(timer.median_us(fn, warmup)), "eager"
    graph = graph_of(fn)
    us = slowest(timer.median_us(graph.replay, warmup))
    del graph
    return us, "graph"


def inputs(M, E, H, k, seed):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return random_batch(M, E, H, k, gen)


def bench_config(name, tokens, timer, reps, floors, rank, world):
    E, H, I, k = CONFIGS[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)  # the same weights on both ranks
    experts = random_experts(E, H, I, gen)
    placement = par.Placement.linear(E, world)
    local, tp_experts = placement.local_experts(experts, rank), par.tp_shard(experts, (rank, world))
    rows = []
    for M in tokens:
        x, weights, ids = inputs(M, E, H, k, seed=1000 * M + 1 + rank)  # each rank its own tokens
        shared = inputs(M, E, H, k, seed=1000 * M)  # TP: the same tokens on both ranks
        out = torch.empty_like(x)
        call_reps = reps_for(M, reps)
        all_ids = torch.empty(world * M, k, dtype=ids.dtype, device="cuda")
        dist.all_gather_into_tensor(all_ids, ids)
        floors_of = {"one_gpu": (M, floor_us(M, E, H, I, k, ids, floors)),
                     "tp": (M, floor_us(M, E, H, I, k, shared[2], floors) / world),
                     "ep": (world * M, floor_us(world * M, E, H, I, k, all_ids, floors) / world)}
        forwards = {"tp": par.TensorParallel(tp_experts)}
        for impl, strategy in EP_STRATEGIES.items():
            forwards[impl] = par.ExpertParallel(local, k, placement, strategy=strategy,
                                                max_tokens=None if strategy == "alltoall" else M)
        us, mode = time_call(timer, lambda: mc.fused_moe(x, experts, weights, ids, out=out), True, call_reps)
        results = {"one_gpu": (us, mode, None)}
        for impl, forward in forwards.items():
            capturable = impl != "ep_alltoall"
            args = shared if impl == "tp" else (x, weights, ids)
            comm = without_experts(forward, H)
            us, mode = time_call(timer, lambda: forward(*args, out=out), capturable, call_reps)
            comm_us, _ = time_call(timer, lambda: comm(*args, out=out), capturable, call_reps)
            results[impl] = (us, mode, comm_us)
        for impl, (us, mode, comm_us) in results.items():
            served, floor = floors_of["ep" if impl.startswith("ep_") else impl]
            rows.append({"impl": impl, "config": name, "M": M, "tokens": served, "mode": mode, "us": us,
                         "comm_us": comm_us, "comm_share": None if comm_us is None else comm_us / us,
                         "floor_us": floor, "x_floor": us / floor})
            if rank == 0:
                share = "" if comm_us is None else f"  comm {comm_us:9.1f} us ({comm_us / us:5.1%})"
                print(f"{name:14s} M={M:6d} {impl:19s} {mode:5s} {us:9.1f} us  x{us / floor:5.2f} floor{share}",
                      flush=True)
        mc.free_workspaces()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=50, help="reps up to M = 256 (fewer above)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    if "WORLD_SIZE" not in os.environ:
        parser.error("run under torchrun: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_parallel")
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
        os.environ.setdefault(key, value)  # NVLink multicast stays off (the device machines' rule)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    timer = Timer(args.reps)
    floors = measure_floors(timer)
    rows = []
    for name in names:
        rows += bench_config(name, [int(m) for m in args.ms.split(",")], timer, args.reps, floors, rank, world)
        torch.cuda.empty_cache()
    if rank == 0:
        path = write_record("bench", {"world_size": world, "floors": floors, "reps": args.reps, "rows": rows},
                            args.out_dir)
        print(f"record: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
