"""benchmarks/stream_floor.py: the bytes it streams per shape, and the stream kernel reading each byte once."""
import pytest
import torch

from benchmarks import stream_floor
from benchmarks.bench_moe import CONFIGS, floor_us


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streams_the_bytes_the_floor_counts(name):
    E, H, I, k = CONFIGS[name]
    gen = torch.Generator().manual_seed(1)
    for M in (1, 16):
        ids = torch.rand(M, E, generator=gen).topk(k, dim=1).indices.to(torch.int32)
        total, first, second = stream_floor.stream_bytes(M, E, H, I, ids)
        floors = {"hbm_bytes_per_s": 4e12, "bf16_flops_per_s": 1e30}   # bandwidth-bound
        assert total * 1e6 / 4e12 == pytest.approx(floor_us(M, E, H, I, k, ids, floors), abs=1e-5)
        assert total % 16 == first % 16 == second % 16 == 0
        assert first + second == pytest.approx(total, abs=32) and first == pytest.approx(2 * second, rel=0.01)


def test_dropped_ids_do_not_count():
    E, H, I = 8, 64, 32
    kept = stream_floor.stream_bytes(1, E, H, I, torch.tensor([[0, 1]]))
    assert stream_floor.stream_bytes(1, E, H, I, torch.tensor([[0, 1, -1, 8]])) == kept


@pytest.fixture(scope="module")
def stream():
    return stream_floor.Stream(stream_floor.build_library())


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [0, 16, 16384 * 7 + 48, (5 << 20) + 4096 + 16])
def test_reads_every_byte_once(stream, nbytes):
    buffer = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, device="cuda")
    checksum = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream(buffer, nbytes, checksum)
    words = buffer[:nbytes].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert checksum.item() == int(words.sum())


@pytest.mark.gpu
def test_refuses_bad_sizes(stream):
    buffer = torch.zeros(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="nbytes"):
        stream(buffer, 65)
    with pytest.raises(RuntimeError, match="CUDA error"):
        stream(buffer, 24)   # not a multiple of 16
    with pytest.raises(ValueError, match="buffer"):
        stream(buffer.float(), 16)
