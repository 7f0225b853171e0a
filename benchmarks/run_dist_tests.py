"""Run the multi-GPU tests under torchrun, one pytest per GPU, and write one tests record.

usage: python -m benchmarks.run_dist_tests [--nproc 2] [--timeout 300] [--out-dir DIR] [pytest args...]
(default pytest args: tests/distributed/test_parallel_nccl.py)

Each rank runs this module again as a worker: a pytest whose outcomes it rewrites to a scratch file
after every test, so what a rank got to survives its death. A test passed if it passed on every
rank; it failed if it failed on one, or if a rank never reported it (it died or hung before). Rank 0
prints to the console, the others to a log shown when they fail. torchrun and its ranks are killed
after --timeout seconds (each rank leaves its pid: torchrun starts them in sessions of their own).
The record is run_gpu_tests' with "world_size" and "per_rank" added. Exits 0 only if every rank ran
to its end and no test failed.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import write_record
from benchmarks.run_gpu_tests import Outcomes

DEFAULT_TESTS = ["tests/distributed/test_parallel_nccl.py"]
# NVLink multicast stays off, as the device machines require (it can take a shared host's GPUs out of
# service); setdefault: a value the environment already has wins.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REPO = Path(__file__).resolve().parent.parent


class _RankOutcomes(Outcomes):
    """Outcomes saved after every report, with the test running, if any."""

    def __init__(self, path):
        super().__init__()
        self.path, self.running = path, None

    def _save(self):
        self.path.write_text(json.dumps({"outcomes": self.by_test, "running": self.running}))

    def pytest_runtest_logstart(self, nodeid):
        self.running = nodeid
        self._save()

    def pytest_runtest_logreport(self, report):
        super().pytest_runtest_logreport(report)
        self._save()

    def pytest_runtest_logfinish(self):
        self.running = None
        self._save()


def _worker(directory, pytest_args):
    import pytest

    rank = int(os.environ["RANK"])
    (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank:
        sys.stdout = sys.stderr = open(directory / f"rank{rank}.log", "w", buffering=1)
    status = pytest.main(["-q", "-rfEs", "-p", "no:cacheprovider", *pytest_args],
                         plugins=[_RankOutcomes(directory / f"rank{rank}.json")])
    (directory / f"rank{rank}.status").write_text(str(int(status)))
    # Returns (exit status 0) whatever pytest said: torchrun tears all ranks down at the first rank that
    # exits nonzero, which could cut another rank off before it writes its outcomes.


def _read(path, default):
    return json.loads(path.read_text()) if path.exists() else default


def merge(per_rank):
    """{test: outcome} over the ranks' {test: outcome} (None for a rank that wrote nothing)."""
    per_rank = [outcomes or {} for outcomes in per_rank]
    merged = {}
    for name in sorted({name for outcomes in per_rank for name in outcomes}):
        got = [outcomes.get(name) for outcomes in per_rank]
        if "failed" in got or None in got:
            merged[name] = "failed"
        elif all(o == "skipped" for o in got):
            merged[name] = "skipped"
        else:
            merged[name] = "passed"
    return merged


def _run(args, pytest_args, directory):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "benchmarks.run_dist_tests", "--worker", str(directory), *pytest_args]
    env = {**NCCL_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout), False
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: kill torchrun's and theirs.
        pids = [proc.pid] + [int(p.read_text()) for p in directory.glob("rank*.pid")]
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return proc.wait(), True


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before torchrun is killed")
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, pytest_args = parser.parse_known_args()
    pytest_args = pytest_args or DEFAULT_TESTS
    if args.worker:
        _worker(Path(args.worker), pytest_args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        torchrun_status, timed_out = _run(args, pytest_args, directory)
        saved = [_read(directory / f"rank{r}.json", {"outcomes": None, "running": None}) for r in range(args.nproc)]
        statuses = [_read(directory / f"rank{r}.status", None) for r in range(args.nproc)]
        logs = {r: (directory / f"rank{r}.log").read_text() for r in range(1, args.nproc)
                if (directory / f"rank{r}.log").exists()}
    per_rank = [s["outcomes"] for s in saved]
    merged = merge(per_rank)
    names = {o: sorted(n for n, got in merged.items() if got == o) for o in ("passed", "failed", "skipped")}
    unfinished = [f"rank {r}: did not finish" + (f" (in {saved[r]['running']})" if saved[r]["running"] else "")
                  for r, s in enumerate(statuses) if s is None]
    failures = names["failed"] + unfinished
    for r, log in logs.items():
        if statuses[r] != 0:
            print(f"---- rank {r} (exit status {statuses[r]}) ----\n" + "\n".join(log.splitlines()[-40:]))
    status = int(bool(failures) or timed_out or torchrun_status != 0 or any(s != 0 for s in statuses))
    path = write_record("tests", {
        "world_size": args.nproc,
        "pytest_args": pytest_args,
        "exit_status": status,
        "torchrun_status": torchrun_status,
        "timed_out": timed_out,
        "passed": len(names["passed"]),
        "failed": len(failures),
        "skipped": len(names["skipped"]),
        "failures": failures,
        "skipped_tests": names["skipped"],
        "per_rank": [{"rank": r, "exit_status": statuses[r],
                      **{o: list((per_rank[r] or {}).values()).count(o) for o in ("passed", "failed", "skipped")}}
                     for r in range(args.nproc)],
    }, args.out_dir)
    print(f"{len(names['passed'])} passed, {len(failures)} failed, {len(names['skipped'])} skipped on "
          f"{args.nproc} ranks{' (timed out)' if timed_out else ''}; record: {path}")
    sys.exit(status)


if __name__ == "__main__":
    main()
