"""Argument validation for the Python entry points.

Every error names the argument and says what was expected and what came, e.g.
``topk_ids: expected int32 or int64 tensor of shape [M, k], got float32 [3, 2]``,
so a caller can fix the call without reading our code. Wrong types and dtypes raise
TypeError; wrong shapes, devices, layouts and values raise ValueError.
"""

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SLOTS = 2**31 - 1  # the kernels count the M * top_k (token, expert) slots in int32 (routing.cuh, GEMM rows)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def describe(t):
    """'float32 [3, 2]': the dtype and shape, as error messages show a tensor."""
    return f"{dtype_name(t.dtype)} {list(t.shape)}"


def _join_or(words):
    words = list(words)
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _as_tuple(dtype):
    return dtype if isinstance(dtype, tuple) else (dtype,)


def _expected(dtype, ndim, shape):
    parts = []
    if dtype is not None:
        parts.append(_join_or(dtype_name(d) for d in _as_tuple(dtype)))
    if ndim is not None and shape is None:
        parts.append(f"{ndim}-D")
    parts.append("tensor")
    if shape is not None:
        parts.append("of shape [" + ", ".join(str(s) for s in shape) + "]")
    return " ".join(parts)


def _shape_matches(actual, shape):
    # A str entry is a named dimension of any size; it only labels the message.
    return len(actual) == len(shape) and all(
        isinstance(want, str) or got == want for got, want in zip(actual, shape))


def _same_device(actual, expected):
    # torch.device("cuda") means "some CUDA device", so an unset index matches any.
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


def check_tensor(name, t, dtype=None, ndim=None, shape=None, device=None, contiguous=False):
    """Raise unless `t` is a tensor that fits every constraint given.

    dtype: a torch.dtype or a tuple of accepted dtypes. shape: a sequence whose entries
    are ints (the exact size) or strs (a named dimension of any size). device: a
    torch.device or str; without an index ("cuda") any device of that type fits.
    """
    # The message is built only on failure: these checks run on every layer call.
    def expected():
        return _expected(dtype, ndim, shape)

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected {expected()}, got {type(t).__name__}")
    if dtype is not None and t.dtype not in _as_tuple(dtype):
        raise TypeError(f"{name}: expected {expected()}, got {describe(t)}")
    if (ndim is not None and t.ndim != ndim) or (shape is not None and not _shape_matches(t.shape, shape)):
        raise ValueError(f"{name}: expected {expected()}, got {describe(t)}")
    if device is not None and not _same_device(t.device, torch.device(device)):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got {describe(t)} with strides {list(t.stride())}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def check_int(name, value, low=None, high=None):
    """Raise unless `value` is an int (not a bool) in [low, high]; None leaves a side open."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")


def check_slots(name, tokens, top_k):
    """Raise unless tokens * top_k slots fit the int32 the kernels count them in."""
    if tokens * top_k > MAX_SLOTS:
        raise ValueError(f"{name}: {tokens} tokens x top_k {top_k} = {tokens * top_k} (token, expert) slots, "
                         f"more than the {MAX_SLOTS} (int32) the kernels index; split the batch")


def check_float(name, value, positive=False):
    """Raise unless `value` is a finite real number (and > 0 when `positive`)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected a {'positive ' if positive else ''}finite number, got {value}")


ACTIVATIONS = ("silu", "swiglu_oai")


def check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor):
    """The scalar options of a MoE layer call (the kernels' and the reference's alike)."""
    check_choice("activation", activation, ACTIVATIONS)
    if swiglu_limit is not None:
        check_float("swiglu_limit", swiglu_limit, positive=True)
    check_float("swiglu_alpha", swiglu_alpha)
    check_float("routed_scaling_factor", routed_scaling_factor)
