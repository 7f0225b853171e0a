"""Synthetic top-k routings for the benchmarks: the uniform one that bench_moe times (and the anchors'
peer benchmark draws alike) and two skewed ones, for tile_waste's simulation, ab_tiles' plan A/Bs and
the peer benchmark under skew (peers_variants).

- "uniform": the top k of uniform scores (k distinct experts per token);
- "dirichlet": expert popularity p ~ Dirichlet(DIRICHLET_ALPHA) per batch, then k distinct
  experts per token drawn without replacement with probability proportional to p;
- "zipf": p_e proportional to 1 / rank^ZIPF_EXPONENT over a random order of the experts, then
  the same draw.
"""
import torch

ROUTINGS = ("uniform", "dirichlet", "zipf")
DIRICHLET_ALPHA = 0.3
ZIPF_EXPONENT = 1.0


def route(kind, M, E, k, gen):
    """int64 [M, k] expert ids on the CPU, k distinct per token, under routing `kind` (gen: a CPU generator)."""
    if kind == "uniform":
        return torch.rand(M, E, generator=gen).topk(k, dim=1).indices
    if kind == "dirichlet":
        # torch's Gamma sampler takes no generator: draw from the global RNG seeded from `gen`,
        # inside fork_rng so that the caller's global RNG is left as it was.
        seed = int(torch.randint(0, 1 << 62, (), generator=gen))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            p = torch.distributions.Dirichlet(torch.full((E,), DIRICHLET_ALPHA, dtype=torch.float64)).sample()
    elif kind == "zipf":
        rank = torch.randperm(E, generator=gen).to(torch.float64) + 1
        p = rank ** -ZIPF_EXPONENT
    else:
        raise ValueError(f"unknown routing {kind!r}; known: {ROUTINGS}")
    return torch.multinomial(p.expand(M, E), k, replacement=False, generator=gen)


def route_like(kind, M, E, k, gen):
    """int32 [M, k] ids on the device of gen (a torch.Generator): drawn by route on the CPU from a seed that
    gen gives, so that a run seeded once draws the same batches wherever it runs."""
    seed = int(torch.randint(0, 1 << 62, (), device=gen.device, generator=gen))
    return route(kind, M, E, k, torch.Generator().manual_seed(seed)).to(gen.device, torch.int32)


def batch_like(kind, M, E, k, gen):
    """(weights float32 [M, k] summing to 1 per token, int32 ids [M, k] from route_like) on gen's device: a batch's
    routing for the peer benchmark or for tuning.autotune's routing argument."""
    ids = route_like(kind, M, E, k, gen)
    weights = torch.rand(M, k, device=gen.device, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).float(), ids


def rows_per_expert(ids, E):
    return torch.bincount(ids.flatten(), minlength=E)
