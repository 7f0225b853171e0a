"""Turn the anchors' peer benchmark output (peers_bench.py, run with moe_cutlass among the peers)
into a bench record, so that ours and the peers' times from one run sit in one evidence file.

usage: python -m benchmarks.peers_record PEERS_JSON [PEERS_JSON ...] [--out-dir DIR]
"""
import argparse
import json

from benchmarks.record import write_record


def rows_of(peers_result):
    rows = []
    for r in peers_result["rows"]:
        for impl in peers_result["peers"]:
            if impl + "_us" not in r:
                continue
            for mode, key in (("graph", impl + "_us"), ("eager", impl + "_eager_us")):
                if key in r:
                    rows.append({"impl": impl, "config": r["config"], "M": r["M"], "mode": mode, "us": r[key],
                                 "floor_us": r["floor_mxfp4_us"], "x_floor": r[key] / r["floor_mxfp4_us"],
                                 "relerr": r.get(impl + "_relerr")})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("peers_json", nargs="+")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    results = [json.load(open(p)) for p in args.peers_json]
    rows = [row for res in results for row in rows_of(res)]
    floors = {"hbm_bytes_per_s": results[0]["hbm_bytes_per_s"], "bf16_flops_per_s": results[0]["bf16_flops_per_s"]}
    # The run happened on the GPU machine: its device name, not this machine's, goes in the record.
    run = {"device": results[0]["device"], "source": "anchors/peers_bench.py", "peers": results[0]["peers"],
           "floors": floors, "rows": rows}
    # benchmarks/peers_variants.py's run: its routing and the shapes it added
    run.update({key: results[0][key] for key in ("routing", "dirichlet_alpha", "zipf_exponent") if key in results[0]})
    shapes = {c: s for res in results for c, s in res.get("model_shapes", {}).items()}
    if shapes:
        run["model_shapes"] = shapes
    path = write_record("bench", run, args.out_dir)
    print(f"record: {path}")
    for cfg in dict.fromkeys(r["config"] for r in rows):
        for M in dict.fromkeys(r["M"] for r in rows if r["config"] == cfg):
            line = " ".join(f"{r['impl']}={r['x_floor']:.2f}x" for r in rows
                            if r["config"] == cfg and r["M"] == M and r["mode"] == "graph")
            print(f"{cfg:14s} M={M:6d} {line}")


if __name__ == "__main__":
    main()
