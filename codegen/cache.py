"""Content-addressed object cache: keys, per-key process locks, atomic publication.

An object's key covers the compiler (`nvcc --version`), the flags, the rendered source
and the content of every header the compile read (its `-MD` dependency list, kept beside
the object). Modification times play no part: a reinstalled header with new content
misses, an untouched tree hits.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_key(nvcc_version: str, flags, source: str) -> str:
    return _sha256(json.dumps([nvcc_version, list(flags), source]).encode())


class HeaderDigests:
    """Content digests of headers, read once per build (kernels share most headers)."""

    def __init__(self):
        self._digests = {}

    def __call__(self, path: str) -> str | None:
        if path not in self._digests:
            try:
                self._digests[path] = _sha256(Path(path).read_bytes())
            except OSError:
                self._digests[path] = None
        return self._digests[path]


def object_key(source_key_: str, headers, digest=None) -> str | None:
    """None when a header that the last compile read is gone (a miss, never an error)."""
    digest = digest or HeaderDigests()
    parts = [source_key_]
    for path in sorted(headers):
        d = digest(path)
        if d is None:
            return None
        parts.append(f"{path}\0{d}")
    return _sha256("\n".join(parts).encode())


def parse_depfile(text: str) -> list:
    """Make-style `target : dep dep \\` (nvcc -MD) -> the dependency paths."""
    _, _, deps = text.replace("\\\n", " ").partition(":")
    return sorted(set(deps.split()))


@contextlib.contextmanager
def locked(path: Path, on_wait=None):
    """Exclusive flock; the kernel drops it when the holder dies, so it never goes stale.
    on_wait() is called once if another process holds it (so the wait is not silent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def temp_path(final: Path) -> Path:
    """A fresh name beside `final`, so os.replace onto it is atomic (same filesystem)."""
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


def publish_text(final: Path, text: str) -> None:
    tmp = temp_path(final)
    tmp.write_text(text)
    os.replace(tmp, final)
