"""Run the test suite on a GPU machine and write a tests record (benchmarks/record.py).

usage: python -m benchmarks.run_gpu_tests [--out-dir DIR] [pytest args...]
Defaults to the GPU-marked tests (-m gpu). Exits with pytest's status.
"""
import argparse
import sys

import pytest

from benchmarks.record import write_record


class Outcomes:
    """pytest plugin: one final outcome per test; a failure in any phase wins."""

    def __init__(self):
        self.by_test = {}

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.by_test[report.nodeid] = "failed"
        elif report.skipped:
            self.by_test.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.by_test.setdefault(report.nodeid, "passed")

    def names(self, outcome):
        return sorted(n for n, o in self.by_test.items() if o == outcome)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    args, pytest_args = parser.parse_known_args()
    pytest_args = pytest_args or ["-m", "gpu", "tests"]
    outcomes = Outcomes()
    status = pytest.main(["-q", "-rfEs"] + pytest_args, plugins=[outcomes])
    path = write_record("tests", {
        "pytest_args": pytest_args,
        "exit_status": int(status),
        "passed": len(outcomes.names("passed")),
        "failed": len(outcomes.names("failed")),
        "skipped": len(outcomes.names("skipped")),
        "failures": outcomes.names("failed"),
        "skipped_tests": outcomes.names("skipped"),
    }, args.out_dir)
    print(f"record: {path}")
    sys.exit(int(status))


if __name__ == "__main__":
    main()
