"""Where the generator reads and writes, relative to the repository root."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def templates_dir(arch: str) -> Path:
    return REPO_ROOT / "templates" / arch


def generated_dir(arch: str) -> Path:
    return REPO_ROOT / "generated" / arch


def build_dir(arch: str) -> Path:
    return REPO_ROOT / "build" / arch


def library_name(arch: str) -> str:
    return f"libmoe_cutlass_{arch}.so"
