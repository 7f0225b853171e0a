"""prepare_experts: validation, and the prepared layout gives back the original weights."""
import pytest
import torch

import moe_cutlass as mc
from moe_cutlass import layout


def mxfp4(E, N, K, gen):
    return (torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen),
            torch.randint(100, 140, (E, N, K // 32), dtype=torch.uint8, generator=gen))


@pytest.mark.parametrize("H, I", [(64, 32), (96, 160), (2880, 2880)])
def test_dequantized_gives_back_concat_weights(H, I):
    gen = torch.Generator().manual_seed(H + I)
    E = 2
    w13, w2 = mxfp4(E, 2 * I, H, gen), mxfp4(E, H, I, gen)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    experts = mc.prepare_experts(*w13, *w2, w13_bias=b13, w2_bias=b2)
    got = experts.dequantized()
    for g, want in zip(got, (mc.dequantize_mxfp4(*w13), mc.dequantize_mxfp4(*w2), b13, b2)):
        assert torch.equal(g, want)


def test_interleaved_is_read_as_gate_up_pairs():
    gen = torch.Generator().manual_seed(1)
    E, H, I = 3, 64, 64
    w13, w2 = mxfp4(E, 2 * I, H, gen), mxfp4(E, H, I, gen)
    bias = torch.randn(E, 2 * I, generator=gen)
    experts = mc.prepare_experts(*w13, *w2, w13_bias=bias, gate_up="interleaved")
    w13_concat, _, b13, _ = experts.dequantized()
    dense = mc.dequantize_mxfp4(*w13)
    assert torch.equal(w13_concat[:, :I], dense[:, 0::2]) and torch.equal(w13_concat[:, I:], dense[:, 1::2])
    assert torch.equal(b13[:, :I], bias[:, 0::2]) and torch.equal(b13[:, I:], bias[:, 1::2])


def test_checkpoint_block_shape_accepted():
    gen = torch.Generator().manual_seed(2)
    w13, w2 = mxfp4(2, 64, 64, gen), mxfp4(2, 64, 32, gen)
    flat = mc.prepare_experts(*w13, *w2)
    ckpt = mc.prepare_experts(w13[0].view(2, 64, 2, 16), w13[1], w2[0].view(2, 64, 1, 16), w2[1])
    assert all(torch.equal(a, b) for a, b in zip(flat.dequantized()[:2], ckpt.dequantized()[:2]))


def test_select_keeps_the_chosen_experts():
    gen = torch.Generator().manual_seed(3)
    experts = mc.prepare_experts(*mxfp4(5, 64, 64, gen), *mxfp4(5, 64, 32, gen))
    sub = experts.select([4, 1])
    assert sub.num_experts == 2
    for full, part in zip(experts.dequantized()[:2], sub.dequantized()[:2]):
        assert torch.equal(part, full[[4, 1]])


def test_prepared_weights_stay_mxfp4_sized():
    gen = torch.Generator().manual_seed(4)
    E, H, I = 4, 256, 128
    experts = mc.prepare_experts(*mxfp4(E, 2 * I, H, gen), *mxfp4(E, H, I, gen))
    nbytes = sum(t.numel() * t.element_size() for d in (experts.w13, experts.w2) for t in d.values()
                 if isinstance(t, torch.Tensor))
    assert nbytes <= E * 3 * H * I * 4.25 / 8 * 1.01


@pytest.mark.parametrize("change, error, words", [
    (dict(w13_blocks=torch.zeros(2, 64, 32, dtype=torch.int16)), TypeError, "w13_blocks"),
    (dict(w2_scales=torch.zeros(2, 64, 1, dtype=torch.float8_e4m3fn)), TypeError, "w2_scales"),
    (dict(w13_blocks=torch.zeros(2, 64, 16, dtype=torch.uint8)), ValueError, "w13_blocks"),
    (dict(w2_scales=torch.zeros(2, 64, 2, dtype=torch.uint8)), ValueError, "w2_scales"),
    (dict(w13_scales=torch.zeros(2, 63, 2, dtype=torch.uint8)), ValueError, "w13_scales"),
    (dict(w13_bias=torch.zeros(2, 65)), ValueError, "w13_bias"),
    (dict(w2_bias=torch.zeros(2, 64, dtype=torch.int32)), TypeError, "w2_bias"),
    (dict(gate_up="alternate"), ValueError, "gate_up"),
])
def test_bad_input_names_the_argument(change, error, words):
    gen = torch.Generator().manual_seed(5)
    (b13, s13), (b2, s2) = mxfp4(2, 64, 64, gen), mxfp4(2, 64, 32, gen)
    kwargs = dict(w13_blocks=b13, w13_scales=s13, w2_blocks=b2, w2_scales=s2)
    kwargs.update(change)
    with pytest.raises(error, match=words):
        mc.prepare_experts(**kwargs)


def test_checkpoint_dtypes_are_read_as_their_bytes():
    # DeepSeek-V4 stores blocks as int8 and scales as float8_e8m0fnu; torch has float4_e2m1fn_x2.
    gen = torch.Generator().manual_seed(6)
    (b13, s13), (b2, s2) = mxfp4(3, 64, 64, gen), mxfp4(3, 64, 32, gen)
    want = mc.prepare_experts(b13, s13, b2, s2).dequantized()
    e8m0 = torch.float8_e8m0fnu
    for blocks_dtype in (torch.int8, torch.float4_e2m1fn_x2):
        got = mc.prepare_experts(b13.view(blocks_dtype), s13.view(e8m0), b2.view(blocks_dtype), s2.view(e8m0))
        assert all(torch.equal(a, b) for a, b in zip(got.dequantized()[:2], want[:2]))


def test_preparation_in_chunks_of_experts(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    E, H, I = 5, 64, 96
    w13, w2 = mxfp4(E, 2 * I, H, gen), mxfp4(E, H, I, gen)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    whole = mc.prepare_experts(*w13, *w2, w13_bias=b13, w2_bias=b2, gate_up="interleaved")
    chunks = []

    def two_at_a_time(E, per_expert, limit=None):
        for e0 in range(0, E, 2):
            chunks.append((e0, min(E, e0 + 2)))
            yield chunks[-1]

    monkeypatch.setattr(layout, "_chunks", two_at_a_time)
    parts = mc.prepare_experts(*w13, *w2, w13_bias=b13, w2_bias=b2, gate_up="interleaved", device="cpu")
    assert chunks[:3] == [(0, 2), (2, 4), (4, 5)]
    assert all(torch.equal(parts.tensors()[n], t) for n, t in whole.tensors().items())


def _per_expert(w13, w2, I, names=("gate_proj", "up_proj", "down_proj", "weight_scale")):
    gate, up, down, scale = names
    out = {}
    for j in range(w13[0].shape[0]):
        for proj, rows in ((gate, slice(0, I)), (up, slice(I, 2 * I))):
            out[f"mlp.experts.{j}.{proj}.weight"] = w13[0][j, rows]
            out[f"mlp.experts.{j}.{proj}.{scale}"] = w13[1][j, rows]
        out[f"mlp.experts.{j}.{down}.weight"] = w2[0][j]
        out[f"mlp.experts.{j}.{down}.{scale}"] = w2[1][j]
    return out


def test_stack_experts_quark_and_deepseek_names():
    gen = torch.Generator().manual_seed(8)
    E, H, I = 4, 64, 32
    w13, w2 = mxfp4(E, 2 * I, H, gen), mxfp4(E, H, I, gen)
    quark = mc.stack_experts(_per_expert(w13, w2, I), prefix="mlp.experts.")
    assert all(torch.equal(quark[n], t) for n, t in zip(("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"),
                                                         (*w13, *w2)))
    deepseek = {n: t.view(torch.int8) if n.endswith("weight") else t.view(torch.float8_e8m0fnu)
                for n, t in _per_expert(w13, w2, I, ("w1", "w3", "w2", "scale")).items()}
    picked = mc.stack_experts(deepseek, prefix="mlp.experts.", experts=[3, 1])
    assert torch.equal(picked["w13_blocks"], w13[0][[3, 1]]) and torch.equal(picked["w2_scales"], w2[1][[3, 1]])
    experts = mc.prepare_experts(**picked)
    assert torch.equal(experts.dequantized()[0], mc.dequantize_mxfp4(w13[0][[3, 1]], w13[1][[3, 1]]))


def test_stack_experts_names_what_is_missing_or_misshapen():
    gen = torch.Generator().manual_seed(9)
    w13, w2 = mxfp4(2, 64, 64, gen), mxfp4(2, 64, 32, gen)
    tensors = _per_expert(w13, w2, 32)
    del tensors["mlp.experts.1.up_proj.weight_scale"]
    with pytest.raises(KeyError, match="mlp.experts.1.up_proj.weight_scale"):
        mc.stack_experts(tensors, prefix="mlp.experts.")
    tensors = _per_expert(w13, w2, 32)
    tensors["mlp.experts.1.down_proj.weight"] = tensors["mlp.experts.1.down_proj.weight"][:, :8]
    with pytest.raises(ValueError, match="mlp.experts.1.down_proj.weight"):
        mc.stack_experts(tensors, prefix="mlp.experts.")
    with pytest.raises(ValueError, match="tensors"):
        mc.stack_experts(tensors, prefix="model.experts.")


@pytest.mark.gpu
def test_preparing_for_the_gpu_holds_the_output_plus_one_chunk():
    import torch.cuda as cuda

    gen = torch.Generator().manual_seed(10)
    E, H, I = 64, 2048, 2048   # W13: 8 experts per chunk of 2**26 codes
    w13 = (torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=gen),
           torch.randint(118, 130, (E, 2 * I, H // 32), dtype=torch.uint8, generator=gen))
    w2 = (torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=gen),
          torch.randint(118, 130, (E, H, I // 32), dtype=torch.uint8, generator=gen))
    cuda.synchronize()
    cuda.reset_peak_memory_stats()
    before = cuda.memory_allocated()
    experts = mc.prepare_experts(*w13, *w2, device="cuda")
    cuda.synchronize()
    output = sum(t.numel() * t.element_size() for t in experts.tensors().values())
    extra = cuda.max_memory_allocated() - before - output
    # One chunk's working set is a few bytes per code of 2**26 codes; all experts at once would
    # take the same per code of E * 2I * H = 2**29 codes.
    assert extra < 16 * 2**26, extra
    assert torch.equal(experts.select([5]).to("cpu").dequantized()[0],
                       mc.dequantize_mxfp4(w13[0][5:6], w13[1][5:6]))
