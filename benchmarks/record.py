"""Evidence records: every GPU test run and benchmark leaves one JSON file in benchmarks/results/.

CI has no GPU, so these files are the only proof of what ran on the H200. The device machine
gets a copy of the tree without .git, so the commit comes from MOE_CUTLASS_COMMIT when set.
"""
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def current_commit() -> str:
    env = os.environ.get("MOE_CUTLASS_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=RESULTS_DIR.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _loaded_library():
    lib = sys.modules.get("moe_cutlass._lib")   # not imported: no kernels ran in this process
    return lib.loaded() if lib is not None else None


def probe_defines() -> list:
    """The macros of a probe build (python -m codegen --define) when the process loaded one, else []."""
    library = _loaded_library()
    return library.defines if library is not None else []


def library_identity() -> dict | None:
    """Which kernel library ran: its path and the link key of its objects (the build's content hash), since the
    library is often built at another commit than the package's (MOE_CUTLASS_LIB)."""
    library = _loaded_library()
    if library is None:
        return None
    return {"path": str(library.path), "link_key": library.manifest.get("link_key")}


def write_record(kind: str, payload: dict, out_dir=None) -> Path:
    """Write {commit, date, device, command, kind, **payload} and return its path, with the library that ran
    (path, link key) when one was loaded, and probe_defines when it was a probe build.

    The file name carries the kind and a UTC timestamp so records never overwrite each other.
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "commit": current_commit(),
        "date": now.isoformat(timespec="seconds"),
        "device": device_name(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "kind": kind,
        **payload,
    }
    defines = probe_defines()
    if defines:
        record["probe_defines"] = defines
    identity = library_identity()
    if identity is not None:
        record["library"] = identity
    directory = Path(out_dir) if out_dir else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kind}_{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def record_main(kind: str, parse_args, run, argv=None) -> int:
    """A benchmark's main: parse_args(argv), run(args) -> (payload, exit status), the record written."""
    args = parse_args(argv)
    payload, status = run(args)
    print(f"record: {write_record(kind, payload, args.out_dir)}")
    return status
