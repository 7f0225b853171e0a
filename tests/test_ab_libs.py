"""benchmarks/ab_libs.py: the libraries' rotation, the records' names and the summary (the timing itself runs on the
H200 only)."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import ab_libs


def test_rotation_reverses_every_other_round():
    assert ab_libs.rotation(["base", "new"], 3) == [(1, ["base", "new"]), (2, ["new", "base"]), (3, ["base", "new"])]


@pytest.mark.parametrize("text", ["base", "base=", "=a.so", "my_lib=a.so"])
def test_bad_pairs_name_the_argument(text):
    with pytest.raises(ValueError, match="--libs"):
        ab_libs.pairs(text, "--libs")


def _args(tmp_path, **kw):
    libs = {}
    for name in ("base", "new"):
        libs[name] = tmp_path / f"{name}.so"
        libs[name].write_bytes(b"")
    defaults = dict(libs=",".join(f"{n}={p}" for n, p in libs.items()), commits="base=aaa,new=bbb", tag="boxes",
                    out_dir=str(tmp_path / "out"), rounds=2, routings="uniform,zipf", configs="dsv3", ms="256",
                    reps=30)
    defaults.update(kw)
    return SimpleNamespace(**defaults), libs


def test_run_names_each_record_by_library_round_and_routing(tmp_path):
    args, libs = _args(tmp_path)
    calls = []

    def fake_call(cmd, env, check):   # ab_tiles: one record into --out-dir
        out = cmd[cmd.index("--out-dir") + 1]
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"bench_2026120{len(calls)}T000000Z.json").write_text("{}")
        calls.append((env["MOE_CUTLASS_LIB"], env.get("MOE_CUTLASS_COMMIT"), cmd[cmd.index("--routing") + 1]))

    written = ab_libs.run(args, call=fake_call)
    names = [p.name for p in written]
    assert names[0].endswith("_boxes_base_r1_uniform.json") and names[1].endswith("_boxes_new_r1_uniform.json")
    assert names[4].endswith("_boxes_new_r2_uniform.json") and names[5].endswith("_boxes_base_r2_uniform.json")
    assert [c[2] for c in calls] == ["uniform"] * 2 + ["zipf"] * 2 + ["uniform"] * 2 + ["zipf"] * 2
    assert calls[0][:2] == (str(libs["base"].resolve()), "aaa") and calls[1][:2] == (str(libs["new"].resolve()), "bbb")
    assert all(p.exists() for p in written) and not (tmp_path / "out" / ".ab_libs_boxes").exists()


def test_run_refuses_a_missing_library(tmp_path):
    args, _ = _args(tmp_path, libs=f"base={tmp_path / 'base.so'},new={tmp_path / 'gone.so'}")
    with pytest.raises(FileNotFoundError, match="new"):
        ab_libs.run(args, call=lambda *a, **k: None)


def _record(path, rows):
    path.write_text(json.dumps({"rows": rows}))
    return path


def _row(config, M, us, picked=True, routing="uniform"):
    return {"config": config, "M": M, "us": us, "picked": picked, "routing": routing}


def test_summary_means_rounds_and_compares_to_the_base(tmp_path):
    files = [
        _record(tmp_path / "bench_1_t_base_r1_uniform.json", [_row("dsv3", 256, 100.0), _row("dsv3", 512, 200.0),
                                                              _row("dsv3", 256, 1.0, picked=False)]),
        _record(tmp_path / "bench_2_t_new_r1_uniform.json", [_row("dsv3", 256, 90.0), _row("dsv3", 512, 210.0)]),
        _record(tmp_path / "bench_3_t_new_r2_uniform.json", [_row("dsv3", 256, 94.0), _row("dsv3", 512, 230.0)]),
        _record(tmp_path / "bench_4_t_base_r2_uniform.json", [_row("dsv3", 256, 100.0), _row("dsv3", 512, 200.0)]),
    ]
    points, totals = ab_libs.summarize(ab_libs.load(files))
    (_, _, m1, mean1, d1), (_, _, m2, mean2, d2) = points
    assert (m1, m2) == (256, 512)
    assert mean1 == {"base": 100.0, "new": 92.0} and d1["new"] == pytest.approx(-8.0)
    assert d2["new"] == pytest.approx(10.0)
    geo, faster, n = totals["new"]
    assert geo == pytest.approx(100 * (math.sqrt(0.92 * 1.10) - 1)) and (faster, n) == (1, 2)
    # against the other library instead
    _, totals = ab_libs.summarize(ab_libs.load(files), base="new")
    assert totals["base"][1:] == (1, 2)


def test_summary_skips_points_a_library_did_not_run_and_rejects_other_names(tmp_path):
    files = [_record(tmp_path / "bench_1_t_base_r1_zipf.json", [_row("qwen3", 64, 10.0, routing="zipf"),
                                                                   _row("qwen3", 128, 20.0, routing="zipf")]),
             _record(tmp_path / "bench_2_t_new_r1_zipf.json", [_row("qwen3", 64, 11.0, routing="zipf")])]
    points, totals = ab_libs.summarize(ab_libs.load(files))
    assert [(p[0], p[2]) for p in points] == [("zipf", 64)] and totals["new"][1:] == (0, 1)
    with pytest.raises(ValueError, match="base 'old'"):
        ab_libs.summarize(ab_libs.load(files), base="old")
    with pytest.raises(ValueError, match="not an ab_libs record name"):
        ab_libs.load([_record(tmp_path / "bench_3.json", [])])
