"""TP ranges of I as vLLM cuts them (whole MX blocks, last rank short), EP runs of experts and maps."""
import pytest
import torch

from moe_cutlass import sharding


@pytest.mark.parametrize("I, size, widths", [
    (2880, 4, [736, 736, 736, 672]),   # gpt-oss-120b: 90 blocks, 23 per rank
    (2880, 8, [384] * 7 + [192]),
    (768, 4, [192] * 4),
    (160, 3, [64, 64, 32]),
])
def test_intermediate_ranges_tile_I(I, size, widths):
    ranges = [sharding.intermediate_range(I, (rank, size)) for rank in range(size)]
    assert [end - start for start, end in ranges] == widths
    assert ranges[0][0] == 0 and ranges[-1][1] == I
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_rank_without_a_share_is_an_error():
    with pytest.raises(ValueError, match="tp: rank 3 of 4"):
        sharding.intermediate_range(96, (3, 4))


@pytest.mark.parametrize("E, size, counts", [(8, 3, [3, 3, 2]), (128, 8, [16] * 8), (5, 5, [1] * 5)])
def test_expert_ranges_and_maps(E, size, counts):
    maps = torch.stack([sharding.expert_map(E, (rank, size)) for rank in range(size)])
    assert maps.dtype == torch.int32
    assert [(m >= 0).sum().item() for m in maps] == counts
    assert ((maps >= 0).sum(0) == 1).all()
    for rank, m in enumerate(maps):
        start, end = sharding.expert_range(E, (rank, size))
        assert m[start:end].tolist() == list(range(end - start))


@pytest.mark.parametrize("value, error, words", [
    ((1,), TypeError, "ep"), ((2, 2), ValueError, "ep rank"), ((0, 0), ValueError, "ep size"),
    ((0, 9), ValueError, "ep: 9 ranks"), ((0.0, 2), TypeError, "ep rank"),
])
def test_bad_ranks_name_the_argument(value, error, words):
    with pytest.raises(error, match=words):
        sharding.expert_range(8, value)
