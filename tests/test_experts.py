"""prepare_experts: validation, and the prepared layout gives back the original weights."""
import pytest
import torch

import moe_cutlass as mc


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
    (dict(w13_blocks=torch.zeros(2, 64, 32, dtype=torch.int8)), TypeError, "w13_blocks"),
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
