"""The MoE layer as torch ops: moe_cutlass::fused_moe, and moe_cutlass::fused_moe_out that writes `out`.

Tracing (torch.compile, torch.export, FakeTensorMode) sees the layer as one opaque op: its fake
implementation gives the output from the inputs' shapes (a symbolic M included) and touches no
data, and the real one launches the kernels through ctypes at run time, which Dynamo could not
trace. An op takes tensors and scalars only, so PreparedExperts travels as its weight tensors,
the int entries of its weight dicts and (E, H, I), and a Workspace as (buffer, max_tokens);
the ops rebuild both. Without a workspace the ops use fused_moe's per-stream cache.

An eager fused_moe call skips the dispatcher: it runs this module's checks and `launch` itself.
"""
import ctypes
import functools
import itertools
import math
import struct
import threading
import weakref
from typing import NamedTuple

import torch

from . import _gemm, _lib, layout
from ._checks import ACTIVATIONS, INDEX_DTYPES, MAX_SLOTS, check_int, check_layer_options, check_slots, check_tensor
from ._device import device_info, require_sm90
from .experts import PreparedExperts
from .workspace import GEMM_KINDS, Workspace, cached_workspace, out_of_memory, pieces

# The int entries of a prepared weight dict (layout.py), each passed to the ops as the int argument
# <weight>_<key>, with the value that a dict without the entry means (as _gemm reads it).
WEIGHT_INTS = {"scale_max": _gemm.MAX_SCALE_BYTE}
WEIGHT_TENSORS = ("blocks", "scales", "bias")  # bias only in a layer with biases


# ---- argument checks, shared by eager fused_moe and the ops ----

def check_experts(experts) -> None:
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected the PreparedExperts that moe_cutlass.prepare_experts returns, "
                        f"got {type(experts).__name__}")


def _check_workspace_type(workspace) -> None:
    if workspace is not None and not isinstance(workspace, Workspace):
        raise TypeError(f"workspace: expected a moe_cutlass.Workspace (allocate_workspace returns one) or None, "
                        f"got {type(workspace).__name__}")


def check_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
               routed_scaling_factor, expert_map, out, workspace, batch_invariant=False) -> None:
    """Raise, naming the argument, unless fused_moe can run on these (metadata only: fake tensors pass)."""
    if type(batch_invariant) is not bool:
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    args = (hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
            routed_scaling_factor, expert_map, out, workspace)
    if not _plainly_valid(*args):
        _check_each(*args)


def _finite(x) -> bool:
    return type(x) in (float, int) and math.isfinite(x)


def _on(t, device, dtype, ndim) -> bool:
    # get_device(): an int, where .device builds a torch.device object (host time is the point here)
    return isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == ndim and t.is_contiguous() \
        and t.get_device() == device


def _plainly_valid(hidden, experts, weights, ids, activation, limit, alpha, scale, expert_map, out, workspace) -> bool:
    """True only when every check of _check_each passes but the experts' device (the eager path checks
    that once per argument block, the ops through their weight tensors), tested in one expression: a
    valid call costs about a microsecond here, and only an invalid one pays for _check_each and its
    message."""
    if type(experts) is not PreparedExperts or not isinstance(hidden, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return False
    device, M = hidden.get_device(), hidden.shape[0] if hidden.dim() == 2 else -1
    return (hidden.is_cuda and _on(hidden, device, torch.bfloat16, 2) and hidden.shape[1] == experts.hidden_size
            and ids.dtype in INDEX_DTYPES and ids.dim() == 2 and ids.shape[0] == M and ids.is_contiguous()
            and ids.get_device() == device and M * ids.shape[1] <= MAX_SLOTS and _on(weights, device, torch.float32, 2)
            and weights.shape == ids.shape
            and activation in ACTIVATIONS and (limit is None or (_finite(limit) and limit > 0)) and _finite(alpha)
            and _finite(scale) and (expert_map is None or _on(expert_map, device, torch.int32, 1))
            and (out is None or (_on(out, device, torch.bfloat16, 2) and out.shape == hidden.shape))
            and (workspace is None or (type(workspace) is Workspace and _on(workspace.buffer, device, torch.uint8, 1)
                                       and type(workspace.max_tokens) is int and workspace.max_tokens >= M)))


def _check_each(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                routed_scaling_factor, expert_map, out, workspace) -> None:
    check_experts(experts)
    H = experts.hidden_size
    check_tensor("hidden_states", hidden_states, dtype=torch.bfloat16, shape=("M", H), contiguous=True)
    M = hidden_states.shape[0]
    check_tensor("topk_ids", topk_ids, dtype=INDEX_DTYPES, shape=(M, "k"), contiguous=True)
    check_slots("hidden_states, topk_ids", M, topk_ids.shape[1])
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_ids.shape), contiguous=True)
    check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, shape=("E_global",), contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H), contiguous=True)
    _check_workspace_type(workspace)
    if workspace is not None:
        check_tensor("workspace.buffer", workspace.buffer, dtype=torch.uint8, ndim=1, contiguous=True)
        check_int("workspace.max_tokens", workspace.max_tokens, 0)
        if workspace.max_tokens < M:
            raise ValueError(f"workspace: sized for up to {workspace.max_tokens} tokens, got a call with {M}")
    device = hidden_states.device
    if device.type != "cuda":
        raise ValueError(f"hidden_states: expected a CUDA tensor on an SM90 GPU, got one on {device}")
    named = {"topk_ids": topk_ids, "topk_weights": topk_weights, "expert_map": expert_map, "out": out,
             "workspace": None if workspace is None else workspace.buffer}
    for name, t in named.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (where hidden_states is), got {t.device}")
    check_experts_device(experts, device)


def check_experts_device(experts, device) -> None:
    if experts.device != device:
        raise ValueError(f"experts: prepared on {experts.device}, hidden_states on {device}; "
                         f"move them with experts.to({str(device)!r})")


def check_pointers(hidden_states, out, workspace) -> None:
    """The kernels move rows in 16-byte vectors (real tensors only: fake ones have no address)."""
    buffer = None if workspace is None else workspace.buffer
    for name, t in (("hidden_states", hidden_states), ("out", out), ("workspace", buffer)):
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")


def _check_weights(experts, device) -> None:
    """What the ops take on trust from nobody: weight tensors that match (E, H, I) (prepare_experts's do)."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    check_int("num_experts", E, 1)
    for name, size in (("hidden_size", H), ("intermediate_size", I)):
        check_int(name, size, 32)
        if size % 32:
            raise ValueError(f"{name}: expected a multiple of 32 (one MX block), got {size}")
    for weight, prepared, N, K in (("w13", experts.w13, 2 * I, H), ("w2", experts.w2, H, I)):
        shapes = layout.prepared_shapes(E, N, K)
        dtypes = {"blocks": torch.uint8, "scales": torch.uint8, "bias": torch.float32}
        for key in WEIGHT_TENSORS:
            if key in prepared:
                check_tensor(f"{weight}_{key}", prepared[key], dtype=dtypes[key], shape=shapes[key], device=device,
                             contiguous=True)


# ---- the kernels ----

_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
MAX_GEMM_PARTS = 5   # MC_MAX_GEMM_PARTS


class GemmPlan(ctypes.Structure):
    """struct McGemmPlan of templates/sm90/moe_layer_call.h: a _gemm.Plan as mc_layer reads it."""

    _fields_ = [("gemm1", _P * MAX_GEMM_PARTS), ("gemm2", _P * MAX_GEMM_PARTS), ("rem_lo", _I32 * MAX_GEMM_PARTS),
                ("rem_hi", _I32 * MAX_GEMM_PARTS), ("row_chunk", _I32), ("num_parts", _I32), ("pdl", _I32)]


class LayerCall(ctypes.Structure):
    """struct McLayerCall of templates/sm90/moe_layer_call.h, field by field: the argument block
    of mc_layer, the one C call that launches expand -> GEMM1 -> GEMM2 -> finalize. mc_layer keeps
    CUDA graphs of the launches in `graphs`; they are freed with the block (see _launch)."""

    _fields_ = [("hidden", _P), ("topk_ids", _P), ("topk_weights", _P), ("out", _P), ("num_tokens", _I64),
                ("stream", _P), ("plan", _P), ("fused", _P),
                ("ids_int64", _I64), ("top_k", _I64), ("num_experts", _I64), ("hidden_size", _I64),
                ("intermediate_size", _I64), ("expert_map", _P), ("num_global_experts", _I64),
                ("w13_blocks", _P), ("w13_scales", _P), ("w13_bias", _P), ("w13_scale_max", _I64),
                ("w2_blocks", _P), ("w2_scales", _P), ("w2_bias", _P), ("w2_scale_max", _I64),
                ("expert_counts", _P), ("expert_offsets", _P), ("sorted_slots", _P), ("slot_to_row", _P),
                ("gathered", _P), ("row_weights", _P), ("expand_workspace", _P), ("expand_workspace_ints", _I64),
                ("inter", _P), ("act_rows", _I64), ("gemm1_workspace", _P), ("gemm1_workspace_bytes", _I64),
                ("gemm2_workspace", _P), ("gemm2_workspace_bytes", _I64), ("activation", _I64),
                ("swiglu_alpha", _F32), ("swiglu_limit", _F32), ("routed_scaling_factor", _F32),
                ("failed", ctypes.c_int32), ("graphs", _P)]


# The per-call fields lead the block (hidden .. fused): a call writes them with one pack_into.
_PER_CALL = struct.Struct("=QQQQqQQQ")
assert [getattr(LayerCall, f).offset for f, _ in LayerCall._fields_[:8]] == list(range(0, _PER_CALL.size, 8))

# Which calls run as ONE launch (templates/sm90/moe_decode.cuh) instead of expand -> GEMM1 ->
# GEMM2 -> finalize: at most FUSED_MAX_TOKENS tokens, at most the kernel's slot limit, at most
# FUSED_MAX_WEIGHTS expert weights per matrix kind summed over the slots (M * top_k * H * I), never
# batch_invariant (whose bits must not depend on the batch). The one launch saves fixed costs
# (launches, expand, finalize, graph gaps) but streams weights slower than the CUTLASS GEMMs.
# Measured on an H200, both paths and both rings in one process pool (benchmarks/NOTES.md
# 2026-12-01 (13)), us, one launch (its ring) / four launches: qwen3 M = 1 24.3 / 35.5 (12.6M weights),
# 2 33.3 / 49.5 (25M), 4 53.7 / 53.4 (50M, a tie), 8 79.0 / 70.8 (101M); gpt-oss 37.5 / 49.8 (33M),
# 55.1 / 69.0 (66M), 92.1 / 95.6 (133M), 148.0 / 138.2 (265M); dsv4-flash 46.1 / 58.6 (50M), 71.4 / 77.7
# (101M), 125.8 / 122.6 (201M); dsv3 82.0 / 92.9 (117M), 139.9 / 137.6 (235M).
FUSED_MAX_TOKENS = 4
FUSED_MAX_WEIGHTS = 136 << 20
# Its shared-memory ring (codegen/configs.py SM90_DECODE_RINGS, one kernel each): 4 stages of K 1024
# from FUSED_WIDE_MIN_WEIGHTS weights on, 7 stages of K 512 below. The wide stages halve the stage
# hand-offs per byte (gpt-oss M = 2 -7%, dsv4-flash M = 2 -9%, dsv3 M = 1 -5.5%, gpt-oss M = 4 -10%);
# with one or two items per CTA the deeper ring of smaller stages fills sooner (qwen3 M = 1 24.3 against
# 25.8 us, M = 2 33.3 against 34.9).
FUSED_KERNELS = ("moe_decode_k512", "moe_decode_k1024")
FUSED_WIDE_MIN_WEIGHTS = 30 << 20

# GEMM1, GEMM2 and finalize as programmatic dependent launches (templates/sm90/pdl.cuh): each
# kernel's CTAs start on the SMs the kernel before leaves free, and GEMM2 loads its first weights
# before GEMM1 completes (benchmarks/NOTES.md, 2026-12-01 (8)). False gives plain stream order, which
# per-kernel profiles need (a dependent kernel's device time would include its wait).
PROGRAMMATIC_LAUNCH = True


class _Gemms(NamedTuple):
    """The kernels of one call: the GEMM plan for mc_layer (kept alive here, its address passed),
    the one-launch layer's entry address or 0, names for error messages in the order of
    McLayerCall.failed."""

    plan: GemmPlan
    plan_address: int
    fused: int
    names: tuple


@functools.lru_cache(maxsize=1)
def fused_max_slots() -> int:
    """Slots (M * top_k) the one-launch layer takes; 0 if the built library lacks one of its kernels."""
    lib = _lib.library()
    if not all(name in lib.kernels for name in FUSED_KERNELS):
        return 0
    return min(int(lib.function(f"mc_sm90_{name}_max_slots")()) for name in FUSED_KERNELS)


def fused_kernel(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int) -> str:
    """The one-launch kernel (its ring) for a call that uses_fused."""
    return FUSED_KERNELS[num_tokens * top_k * hidden_size * intermediate_size >= FUSED_WIDE_MIN_WEIGHTS]


@functools.lru_cache(maxsize=1024)
def _gemms(slots: int, E: int, H: int, I: int, batch_invariant: bool, fused: str | None, ids_int64: bool, tuned,
           pdl: bool) -> _Gemms:
    # The GEMM tiles follow the rows per expert, which the host knows only on average (slots / E):
    # _gemm.plan's parts let the device place each expert's rows. A shape that moe_cutlass.tuning
    # measured (tuned: the two config names, run as one launch each, or the rule's plan, _gemm.tuned_plan) runs that.
    if tuned is not None:
        p = _gemm.tuned_plan(tuned, slots, E, _gemm.configs_of(1), ks=(H, I))
    else:
        p = _gemm.plan(slots, E, _gemm.configs_of(1), batch_invariant, ks=(H, I))
    if len(p.parts) > MAX_GEMM_PARTS:   # only a plan from other split tiles (A/B) can have more
        raise ValueError(f"a GEMM plan of {len(p.parts)} parts ({', '.join(part[0] for part in p.parts)}); "
                         f"mc_layer launches at most {MAX_GEMM_PARTS} per GEMM (MC_MAX_GEMM_PARTS)")
    lib = _lib.library()
    plan = GemmPlan(row_chunk=p.chunk, num_parts=len(p.parts), pdl=int(pdl))
    for i, (config1, config2, lo, hi) in enumerate(p.parts):
        plan.gemm1[i], plan.gemm2[i] = (ctypes.cast(lib.function(f"mc_sm90_{c}"), ctypes.c_void_p).value
                                        for c in (config1, config2))
        plan.rem_lo[i], plan.rem_hi[i] = lo, hi
    fused_name = f"mc_sm90_{fused or FUSED_KERNELS[0]}"   # fused: the one-launch kernel's name, or None
    fused_address = ctypes.cast(lib.function(fused_name), ctypes.c_void_p).value if fused else 0
    expand = "mc_expand_i64" if ids_int64 else "mc_expand_i32"
    gemm_names = tuple(" / ".join(f"mc_sm90_{part[kind]}" for part in p.parts) for kind in (0, 1))
    return _Gemms(plan, ctypes.addressof(plan), fused_address,
                  (expand, *gemm_names, "mc_finalize", "mc_layer (its CUDA graph launch)", fused_name))


def uses_fused(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int,
               batch_invariant: bool = False) -> bool:
    """Whether fused_moe runs a call of this size as the one-launch layer."""
    return (not batch_invariant and num_tokens <= FUSED_MAX_TOKENS
            and num_tokens * top_k * hidden_size * intermediate_size <= FUSED_MAX_WEIGHTS
            and num_tokens * top_k <= fused_max_slots())


def _address(t):
    return None if t is None else t.data_ptr()


def _failed(status: int, name: str) -> RuntimeError:
    return RuntimeError(f"{name} failed: {_lib.library().error_string(status)} (CUDA error {status})")


def launch(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
           routed_scaling_factor, expert_map, out, workspace, batch_invariant=False) -> None:
    """The layer on arguments that check_args passed, on the current stream:
    expand -> GEMM1 (+ activation) -> GEMM2 (x routing weight) -> finalize into `out`, or for
    small batches (uses_fused) the same in one launch."""
    if topk_ids.shape[0] == 0:
        return
    index = hidden_states.get_device()
    if index == torch._C._cuda_getDevice():  # current_device() without its Python-level checks
        _launch(index, hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                routed_scaling_factor, expert_map, out, workspace, batch_invariant)
    else:
        with torch.cuda.device(index):  # the kernels launch on the current device
            _launch(index, hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                    routed_scaling_factor, expert_map, out, workspace, batch_invariant)


# Argument blocks by everything they hold: the addresses of the weights, the workspace (with its
# size and max_tokens, which fix the pieces) and the expert map, the options, and the thread (a
# call rewrites its block's per-call fields). Addresses, not objects, so that the cache keeps no
# memory alive: a block is valid for any tensors at those addresses.
_CALLS_MAX = 256
_calls = {}
_calls_lock = threading.Lock()


def _call_block(experts, workspace, k, ids_dtype, activation, swiglu_limit, swiglu_alpha, routed_scaling_factor,
                expert_map, index):
    """A new argument block, after the checks a call repeats only through the block's key."""
    device = torch.device("cuda", index)
    require_sm90(index)
    check_experts_device(experts, device)
    check_pointers(None, None, workspace)
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    check_slots("workspace", workspace.max_tokens, k)  # the GEMMs take its rows (act_rows) as an int32
    p = pieces(workspace.max_tokens, k, E, H, I, index)
    if workspace.buffer.numel() < p.total:
        raise ValueError(f"workspace: expected a buffer of at least {p.total} bytes for max_tokens="
                         f"{workspace.max_tokens}, top_k={k}, E={E}, H={H}, I={I} (moe_cutlass.workspace_size), "
                         f"got {workspace.buffer.numel()}")
    ws = workspace.buffer.data_ptr()
    w13, w2 = experts.w13, experts.w2
    return LayerCall(
        ids_int64=ids_dtype == torch.int64, top_k=k, num_experts=E, hidden_size=H, intermediate_size=I,
        expert_map=None if expert_map is None else expert_map.data_ptr(),
        num_global_experts=0 if expert_map is None else expert_map.numel(),
        w13_blocks=w13["blocks"].data_ptr(), w13_scales=w13["scales"].data_ptr(),
        w13_bias=_address(w13.get("bias")),
        w13_scale_max=w13.get("scale_max", _gemm.MAX_SCALE_BYTE),
        w2_blocks=w2["blocks"].data_ptr(), w2_scales=w2["scales"].data_ptr(),
        w2_bias=_address(w2.get("bias")),
        w2_scale_max=w2.get("scale_max", _gemm.MAX_SCALE_BYTE),
        expert_counts=ws + p.expert_counts, expert_offsets=ws + p.expert_offsets, sorted_slots=ws + p.sorted_slots,
        slot_to_row=ws + p.slot_to_row, gathered=ws + p.gathered, row_weights=ws + p.row_weights,
        expand_workspace=ws + p.expand_workspace, expand_workspace_ints=p.expand_workspace_ints,
        # The GEMMs' TMA descriptors span whole pieces (max_tokens * k rows), not this batch's rows:
        # rows past an expert are read and masked, and the extent stays the same from call to call.
        inter=ws + p.inter, act_rows=workspace.max_tokens * k,
        gemm1_workspace=ws + p.gemm1_workspace, gemm1_workspace_bytes=p.gemm_workspace_bytes[0],
        gemm2_workspace=ws + p.gemm2_workspace, gemm2_workspace_bytes=p.gemm_workspace_bytes[1],
        activation=_gemm.ACTIVATIONS[activation], swiglu_alpha=swiglu_alpha,
        swiglu_limit=math.inf if swiglu_limit is None else swiglu_limit, routed_scaling_factor=routed_scaling_factor)


def _launch(index, hidden, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
            routed_scaling_factor, expert_map, out, workspace, batch_invariant):
    M, k = topk_ids.shape
    # The raw handle, without building a torch.cuda.Stream object (host time is the point here).
    stream = torch._C._cuda_getCurrentRawStream(index)
    if workspace is None:
        workspace = cached_workspace(M, k, experts.num_experts, experts.hidden_size, experts.intermediate_size,
                                     index, stream)
    w13, w2 = experts.w13, experts.w2
    key = (threading.get_ident(), index, experts.num_experts, experts.hidden_size, experts.intermediate_size,
           w13["blocks"].data_ptr(), w13["scales"].data_ptr(), _address(w13.get("bias")), w13.get("scale_max"),
           w2["blocks"].data_ptr(), w2["scales"].data_ptr(), _address(w2.get("bias")), w2.get("scale_max"),
           workspace.buffer.data_ptr(), workspace.buffer.numel(), workspace.max_tokens, k, topk_ids.dtype,
           activation, swiglu_limit, swiglu_alpha, routed_scaling_factor,
           None if expert_map is None else (expert_map.data_ptr(), expert_map.numel()))
    entry = _calls.get(key)
    if entry is None:
        block = _call_block(experts, workspace, k, topk_ids.dtype, activation, swiglu_limit, swiglu_alpha,
                            routed_scaling_factor, expert_map, index)
        entry = (block, ctypes.addressof(block))
        # When the last reference goes (an evicted block may still be in another call), not at exit:
        # the CUDA context may be gone by then.
        weakref.finalize(block, _release_function(), entry[1]).atexit = False
        with _calls_lock:  # misses only: eviction iterates the dict, which another thread may grow
            if len(_calls) >= _CALLS_MAX:
                del _calls[next(iter(_calls))]
            _calls[key] = entry
    block, address = entry
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    fused = fused_kernel(M, k, H, I) if uses_fused(M, k, H, I, batch_invariant) else None
    # batch_invariant needs its own tiles (pick_config): a tuned table does not apply there.
    tuned = None
    if _gemm._TUNED and not batch_invariant:
        tuned = _gemm.tuned_configs(device_info(index).name, E, H, I, k, M)
    gemms = _gemms(M * k, E, H, I, batch_invariant, fused, topk_ids.dtype == torch.int64, tuned, PROGRAMMATIC_LAUNCH)
    hidden_ptr, out_ptr = hidden.data_ptr(), out.data_ptr()
    if (hidden_ptr | out_ptr) % 16:
        check_pointers(hidden, out, None)
    _PER_CALL.pack_into(block, 0, hidden_ptr, topk_ids.data_ptr(), topk_weights.data_ptr(), out_ptr, M, stream,
                        gemms.plan_address, gemms.fused)
    status = _layer_function()(address)
    if status:
        raise _failed(status, gemms.names[block.failed])


@functools.lru_cache(maxsize=1)
def _layer_function():
    lib = _lib.library()
    check_abi(lib)
    return lib.function("mc_layer")


def abi() -> str:
    """What mc_abi reports in a library built from this version: the prepared layout's version, then every field
    of LayerCall and GemmPlan at its byte offset, and their sizes."""
    structs = [" ".join([name] + [f"{field}@{getattr(struct_type, field).offset}" for field, _ in struct_type._fields_]
                        + [f"size@{ctypes.sizeof(struct_type)}"])
               for name, struct_type in (("McLayerCall", LayerCall), ("McGemmPlan", GemmPlan))]
    return "; ".join([f"format {layout.FORMAT}"] + structs)


def check_abi(lib) -> None:
    """Raises a RuntimeError where the library was built from another version of moe_cutlass: it would read other
    fields of the argument block, or other bits of the prepared weights, and return garbage without an error."""
    ours = abi()
    theirs = lib.function("mc_abi")().decode() if "mc_abi" in lib.signatures else None
    if theirs == ours:
        return
    if theirs is None:
        what = "it has no mc_abi (built before 2026-12-05)"
    else:
        lib_item, our_item = next((a, b) for a, b in itertools.zip_longest(theirs.split(), ours.split(), fillvalue="(end)")
                                  if a != b)
        what = f"it reports {lib_item!r} where this package has {our_item!r} (mc_abi: {theirs!r})"
    raise RuntimeError(f"the kernel library {lib.path} was built from another version of moe_cutlass: {what}; rebuild "
                       f"it with `python -m codegen --arch {_lib.ARCH}`, or set {_lib.ENV_VAR} to a library built from "
                       f"this version")


@functools.lru_cache(maxsize=1)
def _release_function():
    return _lib.library().function("mc_layer_release")


# ---- the ops ----

def _weight_schema(weight: str) -> str:
    return ", ".join([f"Tensor {weight}_blocks", f"Tensor {weight}_scales", f"Tensor? {weight}_bias",
                      *(f"int {weight}_{key}" for key in WEIGHT_INTS)])


_SCHEMA = (f"Tensor hidden_states, {_weight_schema('w13')}, {_weight_schema('w2')}, int num_experts, int hidden_size, "
           "int intermediate_size, Tensor topk_weights, Tensor topk_ids, str activation, float? swiglu_limit, "
           "float swiglu_alpha, float routed_scaling_factor, Tensor? expert_map, Tensor(a!) workspace, "
           "int workspace_max_tokens, bool batch_invariant")
_PER_WEIGHT = len(WEIGHT_TENSORS) + len(WEIGHT_INTS)


def _weight_args(weight: str, prepared: dict) -> tuple:
    for key in prepared:
        if key not in WEIGHT_TENSORS and key not in WEIGHT_INTS:
            raise ValueError(f"experts.{weight}: entry {key!r} has no argument in the moe_cutlass ops "
                             f"(moe_cutlass/ops.py WEIGHT_INTS)")
    return (prepared["blocks"], prepared["scales"], prepared.get("bias"),
            *(int(prepared.get(key, default)) for key, default in WEIGHT_INTS.items()))


def _weights(args) -> dict:
    """_weight_args's inverse."""
    blocks, scales, bias, *ints = args
    prepared = {"blocks": blocks, "scales": scales}
    if bias is not None:
        prepared["bias"] = bias
    prepared.update(zip(WEIGHT_INTS, ints))
    return prepared


def op_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
            routed_scaling_factor, expert_map, workspace, batch_invariant=False) -> tuple:
    """fused_moe's arguments (without out) as the ops take them."""
    check_experts(experts)
    _check_workspace_type(workspace)
    return (hidden_states, *_weight_args("w13", experts.w13), *_weight_args("w2", experts.w2), experts.num_experts,
            experts.hidden_size, experts.intermediate_size, topk_weights, topk_ids, activation, swiglu_limit,
            swiglu_alpha, routed_scaling_factor, expert_map,
            *_workspace_args(workspace, hidden_states.device), batch_invariant)


def _workspace_args(workspace, device) -> tuple:
    # No workspace travels as an empty buffer, not as None: Inductor (torch 2.11) fails to lower an
    # op whose optional mutable argument is None ("getitem is not an OpOverload").
    if workspace is None:
        return torch.empty(0, dtype=torch.uint8, device=device), 0
    return workspace.buffer, workspace.max_tokens


def _layer_args(args) -> dict:
    """op_args's inverse, as fused_moe's keyword arguments."""
    hidden_states, rest = args[0], args[1:]
    w13, w2, rest = _weights(rest[:_PER_WEIGHT]), _weights(rest[_PER_WEIGHT:2 * _PER_WEIGHT]), rest[2 * _PER_WEIGHT:]
    E, H, I, topk_weights, topk_ids, activation, limit, alpha, scale, expert_map, buffer, max_tokens, invariant = rest
    return dict(hidden_states=hidden_states, experts=PreparedExperts(E, H, I, w13, w2), topk_weights=topk_weights,
                topk_ids=topk_ids, activation=activation, swiglu_limit=limit, swiglu_alpha=alpha,
                routed_scaling_factor=scale, expert_map=expert_map,
                workspace=None if buffer.numel() == 0 else Workspace(buffer, max_tokens), batch_invariant=invariant)


def _checked(args, out) -> dict:
    kw = _layer_args(args)
    check_args(**kw, out=out)
    _check_weights(kw["experts"], kw["hidden_states"].device)
    return kw


def empty_out(hidden_states, experts, topk_ids) -> torch.Tensor:
    """fused_moe's output: bf16 [M, H] on hidden_states's device."""
    try:
        return torch.empty_like(hidden_states)  # [M, H] bf16 contiguous, as checked: cheaper than empty()
    except torch.OutOfMemoryError as e:
        M, H = hidden_states.shape[0], experts.hidden_size
        raise out_of_memory("out", 2 * M * H, hidden_states.device,
                            dict(M=M, top_k=topk_ids.shape[1], E=experts.num_experts, H=H,
                                 I=experts.intermediate_size),
                            "call with fewer tokens (split the batch), or pass a preallocated out=") from e


def _empty_out(kw) -> torch.Tensor:
    return empty_out(kw["hidden_states"], kw["experts"], kw["topk_ids"])


def _run(kw, out) -> None:
    launch(**kw, out=out)


def _fused_moe(*args):
    kw = _checked(args, None)
    out = _empty_out(kw)
    _run(kw, out)
    return out


def _fused_moe_fake(*args):
    return _empty_out(_checked(args, None))


def _fused_moe_out(*args):
    *args, out = args
    _run(_checked(args, out), out)


def _fused_moe_out_fake(*args):
    *args, out = args
    _checked(args, out)


torch.library.define("moe_cutlass::fused_moe", f"({_SCHEMA}) -> Tensor")
torch.library.impl("moe_cutlass::fused_moe", "CompositeExplicitAutograd", _fused_moe)
torch.library.register_fake("moe_cutlass::fused_moe", _fused_moe_fake)
torch.library.define("moe_cutlass::fused_moe_out", f"({_SCHEMA}, Tensor(b!) out) -> ()")
torch.library.impl("moe_cutlass::fused_moe_out", "CompositeExplicitAutograd", _fused_moe_out)
torch.library.register_fake("moe_cutlass::fused_moe_out", _fused_moe_out_fake)


def call(hidden_states, experts, topk_weights, topk_ids, activation="silu", swiglu_limit=None, swiglu_alpha=1.702,
         routed_scaling_factor=1.0, expert_map=None, out=None, workspace=None, batch_invariant=False):
    """fused_moe through torch.ops.moe_cutlass, as tracing needs it."""
    args = op_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                   routed_scaling_factor, expert_map, workspace, batch_invariant)
    if out is None:
        return torch.ops.moe_cutlass.fused_moe(*args)
    torch.ops.moe_cutlass.fused_moe_out(*args, out)
    return out
