"""GPU facts read through the CUDA driver (cuda-python): compute capability, SM count.

Nothing touches the driver at import time, so the package imports on machines without
a GPU or a driver; the first query initializes it.
"""

import functools
from dataclasses import dataclass

try:
    from cuda.bindings import driver as _driver
except ImportError:  # cuda-python < 12.6 spells the module cuda.cuda
    from cuda import cuda as _driver


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    capability: tuple  # (major, minor)
    sm_count: int


def _check(result, what):
    err, *values = result
    if err != _driver.CUresult.CUDA_SUCCESS:
        _, name = _driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver: {what} failed with {name.decode() if name else err}")
    return values[0] if len(values) == 1 else values


def _driver_call(fn, *args, what):
    try:
        result = fn(*args)
    except Exception as exc:  # e.g. no libcuda.so at all: cuda-python raises, not returns
        raise RuntimeError(f"CUDA driver unavailable ({what}): {exc}") from exc
    return _check(result, what)


def _init() -> None:
    _driver_call(_driver.cuInit, 0, what="cuInit")


def driver_version() -> str:
    """The driver's CUDA version, e.g. '13.0' (what the statically linked CUDA 13 runtime needs)."""
    _init()
    version = _driver_call(_driver.cuDriverGetVersion, what="cuDriverGetVersion")
    return f"{version // 1000}.{version % 1000 // 10}"


def device_count() -> int:
    _init()
    return _driver_call(_driver.cuDeviceGetCount, what="cuDeviceGetCount")


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> DeviceInfo:
    """Facts of CUDA device `index` (same numbering as torch: both honour CUDA_VISIBLE_DEVICES)."""
    _init()
    dev = _driver_call(_driver.cuDeviceGet, index, what=f"cuDeviceGet({index})")
    attr = _driver.CUdevice_attribute

    def attribute(a):
        return _driver_call(_driver.cuDeviceGetAttribute, a, dev, what=f"cuDeviceGetAttribute({a.name})")

    name = _driver_call(_driver.cuDeviceGetName, 256, dev, what="cuDeviceGetName")
    return DeviceInfo(
        index=index,
        name=name.split(b"\0", 1)[0].decode(),
        capability=(
            attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        sm_count=attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
    )


def device_index(device) -> int:
    """A torch.device, 'cuda:N' string or int -> the CUDA device index."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    import torch  # only callers that pass torch devices need it

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device) -> int:
    return device_info(device_index(device)).sm_count


def require_sm90(device) -> DeviceInfo:
    """Raises unless `device` is an SM90 (Hopper) GPU: the kernels are built for sm_90a only."""
    info = device_info(device_index(device))
    if info.capability != (9, 0):
        major, minor = info.capability
        raise RuntimeError(
            f"moe_cutlass needs an SM90 (Hopper: H100/H200/H20) GPU; cuda:{info.index} is "
            f"{info.name} with compute capability {major}.{minor}"
        )
    return info
