"""Evidence records (benchmarks/record.py, peers_record.py): the fields DESIGN.md section 5 asks for."""
import json
import sys
from types import SimpleNamespace

from benchmarks.peers_record import rows_of
from benchmarks.record import write_record

PEERS_RUN = {
    "device": "NVIDIA H200", "peers": ["flaggems", "moe_cutlass"], "hbm_bytes_per_s": 4.25e12,
    "bf16_flops_per_s": 7e14,
    "rows": [{"config": "gpt-oss-120b", "M": 4, "floor_mxfp4_us": 50.0, "flaggems_us": 190.0,
              "flaggems_eager_us": 400.0, "flaggems_relerr": 4e-3, "moe_cutlass_us": 125.0,
              "moe_cutlass_eager_us": 160.0, "moe_cutlass_relerr": 3e-3}],
}


def test_record_carries_the_required_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CUTLASS_COMMIT", "abc123")
    path = write_record("bench", {"device": "NVIDIA H200", "rows": []}, tmp_path)
    record = json.loads(path.read_text())
    assert {"commit", "date", "device", "command", "kind"} <= set(record)
    assert record["commit"] == "abc123" and record["kind"] == "bench" and record["device"] == "NVIDIA H200"
    assert path.parent == tmp_path and path.name.startswith("bench_")


def test_a_record_names_the_library_and_a_probe_build(tmp_path, monkeypatch):
    library = SimpleNamespace(defines=["MC_PROBE_NO_MMA"], path="build/probe/lib.so", manifest={"link_key": "abc"})
    lib = SimpleNamespace(loaded=lambda: library)
    monkeypatch.setitem(sys.modules, "moe_cutlass._lib", lib)
    record = json.loads(write_record("profile", {"rows": []}, tmp_path).read_text())
    assert record["probe_defines"] == ["MC_PROBE_NO_MMA"]
    assert record["library"] == {"path": "build/probe/lib.so", "link_key": "abc"}
    lib.loaded = lambda: None   # nothing loaded: an ordinary record, no library named
    record = json.loads(write_record("profile", {"rows": []}, tmp_path / "b").read_text())
    assert "probe_defines" not in record and "library" not in record


def test_peer_rows_become_bench_rows():
    rows = rows_of(PEERS_RUN)
    assert len(rows) == 4  # two peers x graph/eager
    ours = next(r for r in rows if r["impl"] == "moe_cutlass" and r["mode"] == "graph")
    assert ours == {"impl": "moe_cutlass", "config": "gpt-oss-120b", "M": 4, "mode": "graph", "us": 125.0,
                    "floor_us": 50.0, "x_floor": 2.5, "relerr": 3e-3}


def test_dist_outcomes_merge_over_ranks():
    from benchmarks.run_dist_tests import merge

    rank0 = {"a": "passed", "b": "passed", "c": "skipped", "d": "passed"}
    rank1 = {"a": "passed", "b": "failed", "c": "skipped"}  # died in d
    assert merge([rank0, rank1]) == {"a": "passed", "b": "failed", "c": "skipped", "d": "failed"}
    assert merge([rank0, None]) == {name: "failed" for name in rank0}  # a rank that wrote nothing


def test_parallel_bench_rows_plot_as_times():
    from benchmarks.plot import parallel_series

    rows = [{"impl": "tp", "config": "dsv3", "M": 1, "us": 90.0, "comm_us": 20.0, "mode": "graph"},
            {"impl": "ep_alltoall", "config": "dsv3", "M": 1, "us": 120.0, "comm_us": 60.0, "mode": "eager"},
            {"impl": "one_gpu", "config": "dsv3", "M": 1, "us": 100.0, "comm_us": None, "mode": "graph"}]
    assert parallel_series({"rows": rows}) == {"dsv3": {"tp": [(1, 90.0, 20.0)], "ep_alltoall": [(1, 120.0, 60.0)],
                                                        "one_gpu": [(1, 100.0, None)]}}
