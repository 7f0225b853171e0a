"""fused_moe from two Python threads at once, and across GPUs (issue 10 item 6)."""
import threading

import pytest
import torch

import moe_cutlass as mc
from tests.helpers import random_experts, random_hidden, random_routing

pytestmark = pytest.mark.gpu

E, H, I, K = 16, 256, 128, 4  # noqa: E741
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _batches(seed):
    """A thread's 20 calls, of several sizes (so both threads grow and reuse their buffers)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    return [(random_hidden(m, H, gen), *random_routing(m, E, K, gen)) for m in (1, 37, 300, 5, 1000) * 4]


def test_two_threads_on_their_own_streams_match_one_thread_bitwise():
    experts = random_experts(E, H, I, torch.Generator("cuda").manual_seed(0), bias=True)
    work = [_batches(1), _batches(2)]
    expected = [[mc.fused_moe(x, experts, w, ids) for x, w, ids in batches] for batches in work]
    torch.cuda.synchronize()

    results, errors = [None, None], []
    start = threading.Barrier(2)

    def worker(n):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())  # the inputs were made there
            start.wait()
            with torch.cuda.stream(stream):
                results[n] = [mc.fused_moe(x, experts, w, ids) for x, w, ids in work[n]]
            stream.synchronize()
        except Exception as exc:  # re-raised in the main thread, where pytest sees it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for n in range(2):
        for i, (got, want) in enumerate(zip(results[n], expected[n])):
            assert torch.equal(got, want), f"thread {n}, call {i} (M={got.shape[0]}) differs"


@two_gpus
def test_experts_on_another_gpu_than_the_tokens_raise():
    gen = torch.Generator("cuda:0").manual_seed(3)
    experts = random_experts(E, H, I, gen).to("cuda:1")
    weights, ids = random_routing(8, E, K, gen)
    with pytest.raises(ValueError, match="experts: prepared on cuda:1, hidden_states on cuda:0"):
        mc.fused_moe(random_hidden(8, H, gen), experts, weights, ids)


@two_gpus
def test_a_layer_on_a_device_other_than_the_current_one():
    gen = torch.Generator("cuda:1").manual_seed(4)
    experts = random_experts(E, H, I, gen, bias=True)
    x, weights, ids = random_hidden(50, H, gen), *random_routing(50, E, K, gen)
    with torch.cuda.device(1):
        expected = mc.fused_moe(x, experts, weights, ids)
    with torch.cuda.device(0):
        got = mc.fused_moe(x, experts, weights, ids)
        torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda:1")
    assert torch.equal(got, expected)
