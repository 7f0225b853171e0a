"""Plot a bench record: time as a multiple of the floor against M, one line per implementation,
one panel per shape (CUDA-graph replay rows), with the design targets drawn in. A multi-GPU record
(bench_parallel, "world_size" > 1) is drawn as time per layer in us (every row, graph or eager), with
the communication part (comm_us) dotted in the implementation's colour.

usage: python -m benchmarks.plot RECORD.json [--out PNG]   (needs matplotlib; default: RECORD.png)
"""
import argparse
import json
from pathlib import Path

# DESIGN.md section 5: 1.3x the floor up to M = 1024 (or floor + 6 us where larger), 1.25x beyond.
TARGET_SMALL, TARGET_LARGE, TARGET_SPLIT_M, TARGET_SLACK_US = 1.3, 1.25, 1024, 6.0


def target_x(M, floor_us):
    if M <= TARGET_SPLIT_M:
        return max(TARGET_SMALL, (floor_us + TARGET_SLACK_US) / floor_us)
    return TARGET_LARGE


def series(record):
    """{config: {impl: [(M, x_floor), ...]}} and {config: [(M, target x), ...]} from graph rows."""
    lines, targets = {}, {}
    for r in record["rows"]:
        if r["mode"] != "graph":
            continue
        lines.setdefault(r["config"], {}).setdefault(r["impl"], []).append((r["M"], r["x_floor"]))
        targets.setdefault(r["config"], {})[r["M"]] = target_x(r["M"], r["floor_us"])
    return lines, {c: sorted(t.items()) for c, t in targets.items()}


def parallel_series(record):
    """{config: {impl: [(M, us, comm_us or None), ...]}} from every row of a multi-GPU record."""
    lines = {}
    for r in record["rows"]:
        lines.setdefault(r["config"], {}).setdefault(r["impl"], []).append((r["M"], r["us"], r.get("comm_us")))
    return lines


def _draw_floor_multiples(ax, impls, targets):
    for impl, points in sorted(impls.items()):
        ms, xs = zip(*sorted(points))
        ax.plot(ms, xs, marker="o", label=impl, linewidth=2.5 if impl == "moe_cutlass" else 1.2)
    ms, xs = zip(*targets)
    ax.plot(ms, xs, "k--", linewidth=1, label="target")


def _draw_times(ax, impls):
    for impl, points in sorted(impls.items()):
        ms, us, comm = zip(*sorted(points))
        line, = ax.plot(ms, us, marker="o", label=impl, linewidth=1.5)
        if any(c is not None for c in comm):
            ax.plot(ms, comm, linestyle=":", color=line.get_color(), linewidth=1.2)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("record")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    record = json.loads(Path(args.record).read_text())
    parallel = record.get("world_size", 1) > 1
    lines, targets = (parallel_series(record), None) if parallel else series(record)
    fig, axes = plt.subplots(1, len(lines), figsize=(4.2 * len(lines), 3.8), squeeze=False)
    for ax, (config, impls) in zip(axes[0], lines.items()):
        if parallel:
            _draw_times(ax, impls)
        else:
            _draw_floor_multiples(ax, impls, targets[config])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        if not parallel:  # a decade or two above the floor: the minor ticks get labels too
            ax.set_ylim(1.0, None)
            ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_title(config)
        ax.set_xlabel("tokens M (per rank for ep_*)" if parallel else "tokens M")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"us per layer ({record['world_size']} GPUs; dotted: comm)" if parallel
                          else "time / floor (CUDA-graph replay)")
    axes[0][-1].legend(fontsize=8)
    routing = f", {record['routing']} routing" if record.get("routing", "uniform") != "uniform" else ""
    fig.suptitle(f"{record.get('device', '')}, commit {record['commit'][:7]}, {record['date'][:10]}{routing}")
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.record).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
