"""The anchors' peer benchmark (../shared/anchors/peers_bench.py) beyond its own inputs: under a skewed routing
(each batch's top-k experts drawn by benchmarks/routings.py, Dirichlet or Zipf expert popularity, instead of the
anchors' uniform draw) and/or on other public MoE models' shapes (bench_moe.MODELS). The same peers, weights,
floors and timing, in one run; the floor follows the routing (peers_bench counts the active experts' weights).

usage: python -m benchmarks.peers_variants PEERS_BENCH OUT_JSON [--routing zipf] [--ms 256,1024] [config ...]
       (configs: the anchors' four and any of bench_moe.MODELS; --models: all of MODELS)
then:  python -m benchmarks.peers_record OUT_JSON   (the record carries "routing" and the shapes it ran)
"""
import argparse
import importlib.util
import json

from benchmarks import routings
from benchmarks.bench_moe import MODELS


def skewed_route(kind):
    """A peers_bench.route replacement: (weights [M, k] float32 summing to 1, int32 ids [M, k]) on the run
    generator g's device, the ids drawn under `kind` on the CPU from a seed that g gives."""
    return lambda M, E, topk, g: routings.batch_like(kind, M, E, topk, g)


def load_peers_bench(path):
    spec = importlib.util.spec_from_file_location("peers_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peers_bench", help="path of the anchors' peers_bench.py")
    parser.add_argument("out_json")
    parser.add_argument("configs", nargs="*")
    parser.add_argument("--routing", default="uniform", choices=routings.ROUTINGS,
                        help="uniform: the anchors' own draw")
    parser.add_argument("--models", action="store_true", help="run every shape of bench_moe.MODELS")
    parser.add_argument("--ms", default=None, help="token counts (default: the anchors' list)")
    args = parser.parse_args(argv)
    bench = load_peers_bench(args.peers_bench)
    configs = args.configs + (list(MODELS) if args.models else [])
    unknown = [c for c in configs if c not in bench.CONFIGS and c not in MODELS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {list(bench.CONFIGS) + list(MODELS)}")
    shapes = {c: MODELS[c] for c in configs if c not in bench.CONFIGS}
    bench.CONFIGS.update(shapes)
    if args.ms:
        bench.MS = [int(m) for m in args.ms.split(",")]
    if args.routing != "uniform":
        bench.route = skewed_route(args.routing)
    bench.sys.argv = [args.peers_bench, args.out_json, *configs]
    bench.main()
    with open(args.out_json) as f:
        result = json.load(f)
    result["routing"] = args.routing
    if args.routing != "uniform":
        result.update(dirichlet_alpha=routings.DIRICHLET_ALPHA, zipf_exponent=routings.ZIPF_EXPONENT)
    if shapes:
        result["model_shapes"] = {c: dict(zip(("E", "H", "I", "top_k"), s)) for c, s in shapes.items()}
    with open(args.out_json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
