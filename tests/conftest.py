"""Shared test setup: tests marked `gpu` run only on an SM90 GPU with the kernel library built."""

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an SM90 GPU, found compute capability {major}.{minor}"
    from moe_cutlass import _lib

    try:
        _lib.library()
    except Exception as exc:  # any reason the library cannot load means: nothing to test
        return f"kernel library not loadable: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = gpu_skip_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
