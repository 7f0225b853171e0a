"""torch.ops.moe_cutlass.fused_moe / fused_moe_out: fake implementations, checks, torch.compile, CUDA graphs.

The fake-tensor tests run anywhere (fake CUDA tensors need no GPU); GPU tests are marked `gpu`.
"""
import ctypes
import dataclasses
import gc
import weakref

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_cutlass as mc
from moe_cutlass import _gemm, _lib, layout, ops
from moe_cutlass._checks import MAX_SLOTS
from benchmarks.fuzz import ROUTING_SMALL_SLOTS
from test_fused_moe import assert_close, random_experts, random_hidden, random_routing

E, H, I, K = 8, 64, 32, 2


def fake_experts(E=E, H=H, I=I, bias=False):
    """PreparedExperts of empty CUDA tensors in the prepared shapes (call inside a FakeTensorMode)."""
    def weight(N, K):
        shapes = layout.prepared_shapes(E, N, K)
        prepared = {key: torch.empty(shapes[key], dtype=torch.uint8, device="cuda") for key in ("blocks", "scales")}
        if bias:
            prepared["bias"] = torch.empty(shapes["bias"], device="cuda")
        return prepared | {"scale_max": 127}
    return mc.PreparedExperts(E, H, I, weight(2 * I, H), weight(H, I))


def fake_call(M=5, **over):
    """fused_moe's arguments for a valid call on fake CUDA tensors, with `over` replacing some."""
    args = dict(hidden_states=torch.empty(M, H, dtype=torch.bfloat16, device="cuda"), experts=fake_experts(),
                topk_weights=torch.empty(M, K, device="cuda"),
                topk_ids=torch.empty(M, K, dtype=torch.int32, device="cuda"), activation="silu", swiglu_limit=None,
                swiglu_alpha=1.702, routed_scaling_factor=1.0, expert_map=None, out=None, workspace=None)
    args.update(over)
    return args


def test_fake_functional_op_gives_the_output_shape():
    with FakeTensorMode():
        args = fake_call(M=7)
        out = torch.ops.moe_cutlass.fused_moe(*ops.op_args(**{k: v for k, v in args.items() if k != "out"}))
        assert out.shape == (7, H) and out.dtype == torch.bfloat16 and out.device.type == "cuda"


def test_fake_out_op_writes_out_and_returns_nothing():
    with FakeTensorMode():
        args = fake_call(M=3, out=torch.empty(3, H, dtype=torch.bfloat16, device="cuda"))
        out = args.pop("out")
        assert torch.ops.moe_cutlass.fused_moe_out(*ops.op_args(**args), out) is None


def test_fused_moe_on_fake_tensors_goes_through_the_op():
    with FakeTensorMode():
        args = fake_call(M=4, experts=fake_experts(bias=True), activation="swiglu_oai", swiglu_limit=7.0)
        assert mc.fused_moe(**args).shape == (4, H)
        out = torch.empty(4, H, dtype=torch.bfloat16, device="cuda")
        assert mc.fused_moe(**(args | {"out": out})) is out


def test_compiled_fused_moe_has_a_symbolic_token_count():
    counter = CompileCounterWithBackend("aot_eager")
    with FakeTensorMode():
        experts = fake_experts(bias=True)

        @torch.compile(backend=counter, fullgraph=True, dynamic=True)
        def layer(x, weights, ids):
            return mc.fused_moe(x, experts, weights, ids, swiglu_limit=10.0)

        compiles = []
        for M in (5, 9, 17):
            args = fake_call(M)
            out = layer(args["hidden_states"], args["topk_weights"], args["topk_ids"])
            assert out.shape == (M, H) and out.dtype == torch.bfloat16
            compiles.append(counter.frame_count)
    assert compiles[0] >= 1 and compiles[-1] == compiles[0]  # no recompilation for a new M


@pytest.mark.parametrize("over, error, name", [
    (lambda: dict(hidden_states=torch.empty(5, H, device="cuda")), TypeError, "hidden_states"),
    (lambda: dict(hidden_states=torch.empty(5, H + 32, dtype=torch.bfloat16, device="cuda")), ValueError,
     "hidden_states"),
    (lambda: dict(hidden_states=torch.empty(5, H, dtype=torch.bfloat16)), ValueError, "hidden_states"),
    (lambda: dict(topk_ids=torch.empty(5, K, device="cuda")), TypeError, "topk_ids"),
    (lambda: dict(topk_ids=torch.empty(6, K, dtype=torch.int32, device="cuda")), ValueError, "topk_ids"),
    (lambda: dict(topk_weights=torch.empty(5, K + 1, device="cuda")), ValueError, "topk_weights"),
    (lambda: dict(topk_weights=torch.empty(5, K, device="cpu")), ValueError, "topk_weights"),
    (lambda: dict(hidden_states=torch.empty(2**30, H, dtype=torch.bfloat16, device="cuda"),  # 2^31 slots
                  topk_ids=torch.empty(2**30, K, dtype=torch.int32, device="cuda"),
                  topk_weights=torch.empty(2**30, K, device="cuda")), ValueError, "hidden_states, topk_ids"),
    (lambda: dict(activation="gelu"), ValueError, "activation"),
    (lambda: dict(swiglu_limit=0.0), ValueError, "swiglu_limit"),
    (lambda: dict(swiglu_alpha=float("nan")), ValueError, "swiglu_alpha"),
    (lambda: dict(routed_scaling_factor=True), TypeError, "routed_scaling_factor"),
    (lambda: dict(expert_map=torch.empty(16, dtype=torch.int64, device="cuda")), TypeError, "expert_map"),
    (lambda: dict(out=torch.empty(5, H, device="cuda")), TypeError, "out"),
    (lambda: dict(out=torch.empty(4, H, dtype=torch.bfloat16, device="cuda")), ValueError, "out"),
    (lambda: dict(experts="w"), TypeError, "experts"),
    (lambda: dict(workspace=torch.empty(100, dtype=torch.uint8, device="cuda")), TypeError, "workspace"),
    (lambda: dict(workspace=mc.Workspace(torch.empty(100, device="cuda"), 8)), TypeError, "workspace"),
    (lambda: dict(workspace=mc.Workspace(torch.empty(100, dtype=torch.uint8, device="cuda"), 4)), ValueError,
     "workspace"),
])
def test_checks_name_the_argument_and_the_quick_test_agrees(over, error, name):
    with FakeTensorMode():
        good = fake_call()
        assert ops._plainly_valid(*good.values())
        ops.check_args(**good)
        bad = good | over()
        # The one-expression test must never pass what the full checks refuse.
        assert not ops._plainly_valid(*bad.values())
        with pytest.raises(error, match=name):
            ops.check_args(**bad)


@pytest.mark.parametrize("weight, key, shape, error", [
    ("w13", "blocks", None, TypeError),
    ("w2", "scales", (E, 1, 128), ValueError),
    ("w13", "bias", (E, 64), ValueError),
])
def test_op_checks_the_weight_tensors(weight, key, shape, error):
    with FakeTensorMode():
        args = fake_call(experts=fake_experts(bias=True))
        args.pop("out")
        experts = args["experts"]
        prepared = dict(getattr(experts, weight))
        t = prepared[key]
        prepared[key] = t.float() if shape is None else torch.empty(shape, dtype=t.dtype, device="cuda")
        args["experts"] = mc.PreparedExperts(E, H, I, **({"w13": experts.w13, "w2": experts.w2} | {weight: prepared}))
        with pytest.raises(error, match=f"{weight}_{key}"):
            torch.ops.moe_cutlass.fused_moe(*ops.op_args(**args))


def test_op_checks_the_sizes():
    with FakeTensorMode():
        args = fake_call()
        args.pop("out")
        args["experts"] = dataclasses.replace(args["experts"], hidden_size=48)
        args["hidden_states"] = torch.empty(5, 48, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="hidden_size"):
            torch.ops.moe_cutlass.fused_moe(*ops.op_args(**args))


def test_the_slot_limit_is_the_kernels_int32():
    with FakeTensorMode():  # fake tensors: no memory behind these sizes
        def call(M, k):
            return fake_call(M, hidden_states=torch.empty(M, H, dtype=torch.bfloat16, device="cuda"),
                             topk_ids=torch.empty(M, k, dtype=torch.int32, device="cuda"),
                             topk_weights=torch.empty(M, k, device="cuda"))
        most = call(MAX_SLOTS, 1)
        assert ops._plainly_valid(*most.values())
        assert mc.fused_moe(**most).shape == (MAX_SLOTS, H)
        one_more = call((MAX_SLOTS + 1) // 4, 4)
        for fused_moe in (ops.check_args, mc.fused_moe):  # the checks alone, and the layer through the op
            with pytest.raises(ValueError, match=f"hidden_states, topk_ids: .*{MAX_SLOTS} \\(int32\\)"):
                fused_moe(**one_more)


def test_an_output_that_does_not_fit_says_so(monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    experts = cpu_experts(False)
    monkeypatch.setattr(torch, "empty_like", no_memory)
    with pytest.raises(torch.OutOfMemoryError, match=f"out: {2 * 1000 * H} bytes .* for M=1000, top_k=3, E={E}, "
                                                     f"H={H}, I={I} .*out=") as info:
        ops.empty_out(torch.zeros(1000, H), experts, torch.zeros(1000, 3))
    assert str(info.value.__cause__) == "CUDA out of memory"


def cpu_experts(bias):
    gen = torch.Generator().manual_seed(0)
    w13 = mc.quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen))
    w2 = mc.quantize_mxfp4(torch.randn(E, H, I, generator=gen))
    biases = dict(w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H)) if bias else {}
    return mc.prepare_experts(*w13, *w2, **biases)


@pytest.mark.parametrize("bias", [False, True])
def test_every_entry_of_the_prepared_dicts_reaches_the_op(bias):
    experts = cpu_experts(bias)
    workspace = mc.Workspace(torch.empty(64, dtype=torch.uint8), 3)
    args = (torch.empty(3, H), experts, torch.empty(3, K), torch.empty(3, K), "swiglu_oai", 7.0, 1.5, 2.0, None,
            workspace)
    back = ops._layer_args(ops.op_args(*args))
    assert back["experts"].w13 == experts.w13 and back["experts"].w2 == experts.w2  # the same objects, ints too
    assert "scale_max" in experts.w13 and back["workspace"] == workspace
    assert (back["activation"], back["swiglu_limit"], back["swiglu_alpha"], back["routed_scaling_factor"]) == \
           ("swiglu_oai", 7.0, 1.5, 2.0)


def test_a_dict_without_scale_max_takes_the_path_right_for_every_byte():
    experts = cpu_experts(False)
    w13 = {k: v for k, v in experts.w13.items() if k != "scale_max"}
    assert ops._weights(ops._weight_args("w13", w13))["scale_max"] == _gemm.MAX_SCALE_BYTE


def test_a_dict_entry_the_ops_do_not_know_is_refused():
    experts = cpu_experts(False)
    with pytest.raises(ValueError, match="experts.w2"):
        ops._weight_args("w2", experts.w2 | {"tile": 3})


def test_select_experts_compiles_without_graph_breaks():
    counter = CompileCounterWithBackend("aot_eager")
    route = torch.compile(mc.select_experts, backend=counter, fullgraph=True, dynamic=True)
    options = dict(scoring="sigmoid", num_expert_group=4, topk_group=2, correction_bias=torch.randn(16))
    compiles = []
    for M in (3, 11):
        logits = torch.randn(M, 16)
        (weights, ids), (want_weights, want_ids) = route(logits, 4, **options), mc.select_experts(logits, 4, **options)
        assert torch.equal(ids, want_ids) and torch.allclose(weights, want_weights)
        compiles.append(counter.frame_count)
    assert compiles[0] >= 1 and compiles[-1] == compiles[0]  # no recompilation for a new M


# ---- GPU: the real ops ----

def gpu_case(M, variant, seed=0):
    """(hidden, experts, weights, ids, options) on the GPU, fresh random data with distinct block scales."""
    gen = torch.Generator("cuda").manual_seed(seed)
    E_, H_, I_, k = 16, 256, 128, 4
    experts = random_experts(E_, H_, I_, gen, bias=variant == "gpt_oss",
                             gate_up="interleaved" if variant == "gpt_oss" else "concat")
    x = random_hidden(M, H_, gen)
    weights, ids = random_routing(M, E_, k, gen)
    options = {"plain": {}, "gpt_oss": dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0),
               "deepseek": dict(swiglu_limit=10.0, routed_scaling_factor=2.5)}.get(variant, {})
    if variant == "expert_map":  # 32 global experts, this rank holds the odd ones; int64 ids
        expert_map = torch.full((2 * E_,), -1, dtype=torch.int32, device="cuda")
        expert_map[1::2] = torch.arange(E_, dtype=torch.int32, device="cuda")
        weights, ids = random_routing(M, 2 * E_, k, gen)
        ids, options = ids.long(), dict(expert_map=expert_map)
    if variant == "workspace":
        options = dict(workspace=mc.allocate_workspace(M, k, experts))
    return x, experts, weights, ids, options


VARIANTS = ["plain", "gpt_oss", "deepseek", "expert_map", "workspace"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_opcheck(variant):
    x, experts, weights, ids, options = gpu_case(37, variant)
    args = ops.op_args(x, experts, weights, ids, options.get("activation", "silu"), options.get("swiglu_limit"),
                       options.get("swiglu_alpha", 1.702), options.get("routed_scaling_factor", 1.0),
                       options.get("expert_map"), options.get("workspace"))
    torch.library.opcheck(torch.ops.moe_cutlass.fused_moe.default, args)
    out = torch.empty(37, experts.hidden_size, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.moe_cutlass.fused_moe_out.default, (*args, out))


class MoEBlock(torch.nn.Module):
    """What an engine compiles: a module holding the experts, routing given by the caller."""

    def __init__(self, experts, **options):
        super().__init__()
        self.experts, self.options = experts, options

    def forward(self, x, weights, ids, out=None):
        return mc.fused_moe(x, self.experts, weights, ids, out=out, **self.options)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_module_equals_eager_bitwise(variant):
    torch._dynamo.reset()
    _, experts, _, _, options = gpu_case(64, variant)
    block = MoEBlock(experts, **options)
    compiled = torch.compile(block, fullgraph=True)
    for seed, M in enumerate((64, 1, 7, 33)):  # a new M must not need a new trace per M
        x, _, weights, ids, _ = gpu_case(M, "expert_map" if variant == "expert_map" else "plain", seed=seed + 1)
        want = block(x, weights, ids)
        assert torch.equal(compiled(x, weights, ids), want)
        out = torch.full_like(want, float("nan"))
        compiled(x, weights, ids, out=out)
        assert torch.equal(out, want)
        assert_close(want, mc.reference.fused_moe_float(x, experts, weights, ids, **{
            k: v for k, v in options.items() if k != "workspace"}))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "workspace"])
def test_compiled_module_in_a_cuda_graph_replays_new_inputs(variant):
    torch._dynamo.reset()
    M = 48
    x, experts, weights, ids, options = gpu_case(M, variant, seed=7)
    block = MoEBlock(experts, **options)
    compiled = torch.compile(block, fullgraph=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and size the buffers outside the capture
        for _ in range(2):
            compiled(x, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, weights, ids)
    for seed in (8, 9):
        new_x, _, new_weights, new_ids, _ = gpu_case(M, "plain", seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, block(new_x, new_weights, new_ids))
        assert_close(out, mc.reference.fused_moe_float(new_x, experts, new_weights, new_ids))


class RoutedMoE(torch.nn.Module):
    """Router + select_experts + the layer, compiled as one graph."""

    def __init__(self, experts, top_k):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = torch.nn.Linear(experts.hidden_size, experts.num_experts, bias=False, device="cuda",
                                      dtype=torch.bfloat16)

    def forward(self, x):
        weights, ids = mc.select_experts(self.router(x), self.top_k)
        return mc.fused_moe(x, self.experts, weights, ids), weights, ids


@pytest.mark.gpu
def test_compiled_router_and_layer_match_the_reference():
    torch._dynamo.reset()
    x, experts, _, _, _ = gpu_case(100, "plain", seed=10)
    compiled = torch.compile(RoutedMoE(experts, top_k=4), fullgraph=True)
    out, weights, ids = compiled(x)
    assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids))


def test_the_built_library_has_this_packages_abi():
    """ops.LayerCall and ops.GemmPlan mirror struct McLayerCall and struct McGemmPlan
    (templates/sm90/moe_layer_call.h, MC_MAX_GEMM_PARTS included) field by field, and layout.FORMAT is
    MC_PREPARED_FORMAT: the built library reports the compiler's offsets (no GPU needed to load it)."""
    try:
        lib = _lib.library()
    except _lib.LibraryNotFound:
        pytest.skip("the kernel library is not built")
    assert lib.function("mc_abi")().decode() == ops.abi()


def test_abi_names_every_field():
    items = ops.abi().split("; ")
    assert items[0] == f"format {layout.FORMAT}"
    for item, struct_type in zip(items[1:], (ops.LayerCall, ops.GemmPlan), strict=True):
        fields = item.split()[1:]
        assert [f.split("@")[0] for f in fields] == [name for name, _ in struct_type._fields_] + ["size"]
        assert fields[-1] == f"size@{ctypes.sizeof(struct_type)}"


class ForeignLibrary:
    """A kernel library as ops sees it, whose mc_abi reports `abi` (None: it has none)."""

    path = "/elsewhere/libmoe_cutlass_sm90.so"

    def __init__(self, abi):
        self.abi = abi
        self.signatures = {"mc_layer": {}} | ({"mc_abi": {}} if abi is not None else {})

    def function(self, symbol):
        assert symbol == "mc_abi"
        return lambda: self.abi.encode()


def _moved(abi, field, offset):
    return " ".join(f"{field}@{offset}" if item.startswith(f"{field}@") else item for item in abi.split(" "))


@pytest.mark.parametrize("abi,reported", [
    (None, "it has no mc_abi"),
    (ops.abi().replace(f"format {layout.FORMAT};", f"format {layout.FORMAT - 1};"),
     f"'{layout.FORMAT - 1};' where this package has '{layout.FORMAT};'"),
    (_moved(ops.abi(), "out", 40), "'out@40' where this package has 'out@24'"),
    (ops.abi() + " extra@136", "'extra@136' where this package has '(end)'"),
    (ops.abi().rsplit(" ", 2)[0], "'(end)' where this package has 'pdl@128'"),
])
def test_a_library_of_another_version_is_refused(abi, reported, monkeypatch):
    """A library built from another version of the argument block or the prepared layout would read other fields or
    bits and return garbage without an error: the first layer call refuses it, naming the library and the difference."""
    with pytest.raises(RuntimeError, match="another version of moe_cutlass") as info:
        ops.check_abi(ForeignLibrary(abi))
    assert ForeignLibrary.path in str(info.value) and reported in str(info.value)
    assert "python -m codegen --arch sm90" in str(info.value)
    ops.check_abi(ForeignLibrary(ops.abi()))
    monkeypatch.setattr(_lib, "library", lambda: ForeignLibrary(abi))
    ops._layer_function.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="another version of moe_cutlass"):
            ops._layer_function()
    finally:
        ops._layer_function.cache_clear()


# ---- GPU: repeated eager calls replay mc_layer's CUDA graph (templates/sm90/layer_launch.cuh) ----

def graph_count(experts, workspace) -> int:
    """CUDA graphs ready in the argument block that calls on `experts` with `workspace` use."""
    count = _lib.library().function("mc_layer_graph_count")
    blocks = [address for key, (_, address) in ops._calls.items()
              if workspace.buffer.data_ptr() in key and experts.w13["blocks"].data_ptr() in key]
    assert len(blocks) == 1
    return count(blocks[0])


def direct(x, experts, weights, ids, **options):
    """The layer through the direct launches: the first call on a fresh workspace (a new argument block)."""
    workspace = mc.allocate_workspace(x.shape[0], ids.shape[1], experts)
    return mc.fused_moe(x, experts, weights, ids, workspace=workspace, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "gpt_oss", "expert_map"])
def test_replayed_calls_take_each_calls_arguments(variant, monkeypatch):
    """One block, calls queued back to back without a sync, each with its own tokens, output and size
    (both expand paths: 4 * 4200 slots is past the one-kernel path): every output is its own call's,
    so a node update cannot have reached a replay already in flight."""
    _, experts, _, _, options = gpu_case(8, variant)
    workspace = mc.allocate_workspace(4200, 4, experts)
    monkeypatch.setattr(ops, "_calls", {})  # no block of an earlier test at reused addresses
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 0)  # the four launches, whose graph this is about
    calls = []
    for seed, M in enumerate((5, 5, 1, 37, 5, 4200, 4200, 2, 5), 20):
        x, _, weights, ids, _ = gpu_case(M, variant, seed=seed)
        out = torch.full((M, experts.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        mc.fused_moe(x, experts, weights, ids, out=out, workspace=workspace, **options)
        calls.append((out, x, weights, ids))
    torch.cuda.synchronize()
    assert graph_count(experts, workspace) == 2  # the one-kernel and the three-kernel expand, each replayed
    for out, x, weights, ids in calls:
        assert torch.equal(out, direct(x, experts, weights, ids, **options))
    out, x, weights, ids = calls[-1]
    assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids, **options))


def programmatic_edges(graph) -> list:
    """The dependency types along the kernel chain of a captured graph, in launch order (True: a
    programmatic dependent launch on the kernel before)."""
    runtime = pytest.importorskip("cuda.bindings.runtime")
    raw = runtime.cudaGraph_t(graph.raw_cuda_graph())
    err, _, _, _, n = runtime.cudaGraphGetEdges(raw, 0)
    assert err == runtime.cudaError_t.cudaSuccess
    err, frm, to, data, n = runtime.cudaGraphGetEdges(raw, n)
    assert err == runtime.cudaError_t.cudaSuccess
    after = {int(a): (int(b), d.type) for a, b, d in zip(frm[:n], to[:n], data[:n])}
    assert len(after) == n  # a chain: every node has at most one successor
    node = (set(after) - {b for b, _ in after.values()}).pop()
    kinds = []
    while node in after:
        node, kind = after[node]
        kinds.append(kind == runtime.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic)
    return kinds


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 4200])
def test_gemms_and_finalize_are_programmatic_dependent_launches(M, monkeypatch):
    """Captured into a caller's graph, the layer is one chain in which every kernel after the first
    (expand's later kernels, every GEMM launch, the finalize) is a programmatic dependent launch on
    the kernel before (templates/sm90/pdl.cuh). The graph, replayed on fresh inputs written into its
    buffers, gives each call's reference result."""
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 0)
    x, experts, weights, ids, _ = gpu_case(M, "gpt_oss", seed=50)
    options = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    workspace = mc.allocate_workspace(M, ids.shape[1], experts)
    out = torch.empty(M, experts.hidden_size, dtype=torch.bfloat16, device="cuda")
    mc.fused_moe(x, experts, weights, ids, out=out, workspace=workspace, **options)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        mc.fused_moe(x, experts, weights, ids, out=out, workspace=workspace, **options)
    kinds = programmatic_edges(graph)
    expand_kernels = 1 if M * ids.shape[1] <= ROUTING_SMALL_SLOTS else 3
    assert kinds == [True] * len(kinds)
    assert len(kinds) >= expand_kernels + 2  # GEMM1, GEMM2 (one launch each at least), finalize
    graph.instantiate()
    for seed in (51, 52):
        x2, _, weights2, ids2, _ = gpu_case(M, "gpt_oss", seed=seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, mc.reference.fused_moe_float(x2, experts, weights2, ids2, **options))


@pytest.mark.gpu
def test_a_replayed_call_runs_on_the_callers_stream():
    """The graph launches on the current stream: work queued after it on that stream sees its output."""
    x, experts, weights, ids, _ = gpu_case(9, "plain", seed=30)
    want = direct(x, experts, weights, ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the second call captures, the third replays
            torch.cuda._sleep(1_000_000)  # the GPU still busy when the graph is queued
            got = mc.fused_moe(x, experts, weights, ids) * 1  # read on the same stream
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_evicted_blocks_go_with_their_graphs_and_calls_stay_right(monkeypatch):
    """Six argument blocks through a cache of four, each called twice (the second call replays its
    graph), twice over: every call gives its own bits, and an evicted block is freed (its graphs with
    it: weakref.finalize calls mc_layer_release) once nothing holds it."""
    monkeypatch.setattr(ops, "_CALLS_MAX", 4)
    monkeypatch.setattr(ops, "_calls", {})
    x, experts, weights, ids, _ = gpu_case(9, "plain", seed=40)
    scales = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5)  # the scale is part of a block's key
    want = {s: direct(x, experts, weights, ids, routed_scaling_factor=s) for s in scales}
    blocks = []
    for _ in range(2):
        for s in scales:
            for _ in range(2):
                assert torch.equal(mc.fused_moe(x, experts, weights, ids, routed_scaling_factor=s), want[s])
            blocks.append(weakref.ref(next(reversed(ops._calls.values()))[0]))
    assert len(ops._calls) == 4
    gc.collect()
    assert sum(b() is not None for b in blocks) == 4
    assert_close(want[2.5], mc.reference.fused_moe_float(x, experts, weights, ids, routed_scaling_factor=2.5))


def test_a_plan_with_more_parts_than_the_layer_launches_is_refused(monkeypatch):
    six = _gemm.split_plan(4096 * 4, 128, (_gemm.WIDE_TILE, *_gemm.SPLIT_TILES, "m128n16k256_coop"))
    assert len(six.parts) == 6 > ops.MAX_GEMM_PARTS
    monkeypatch.setattr(_gemm, "configs_of", lambda kind: ())
    monkeypatch.setattr(_gemm, "plan", lambda *a, **kw: six)
    with pytest.raises(ValueError, match="6 parts.*at most 5"):
        ops._gemms.__wrapped__(4096 * 4, 128, 2880, 2880, False, None, False, None, True)
