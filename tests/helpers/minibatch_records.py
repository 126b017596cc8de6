"""Sequence records with random tokens, advantages, log-probs and routes for the micro-batch
builder's tests, field-by-field comparisons of records and micro-batches, and the gloo worker of
the "budget" exchange."""

import torch

from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.records import record

L, K, E = 3, 2, 8


def _routes(n, seed):
    """[n, L, K] distinct experts per position (int64, as engines give them)."""
    return torch.rand(n, L, E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., :K]


def _records(lengths, seed=0, routes=False, version=0):
    """Records of (prompt, response) lengths with random tokens, advantages and log-probs."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    return [record(tokens(p), tokens(r), float(torch.randn(1, generator=gen)), (-torch.rand(r, generator=gen)).tolist(),
                   _routes(p + r - 1, seed * 100 + i) if routes else None, version)
            for i, (p, r) in enumerate(lengths)]


def _same_record(a, b):
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs) and a.advantage == b.advantage
    assert a.version == b.version
    assert (a.routes is None) == (b.routes is None)
    if a.routes is not None:
        assert b.routes.dtype == torch.int16 and torch.equal(b.routes, a.routes.to(torch.int16))


def _same_microbatch(a, b):
    for f in ("tokens", "position_ids", "labels", "response_mask", "advantages", "rollout_logprob", "routes",
              "cu_seqlens"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x, y), f
    assert (a.seed, a.max_seqlen, a.cp_size) == (b.seed, b.max_seqlen, b.cp_size)


def _budget_worker(lengths, mode):
    import torch.distributed as dist

    from stapo_megatron.mcore.parallel import init_parallel

    groups = init_parallel(1, 1)
    rank = dist.get_rank()
    records = _records(lengths, seed=3, routes=True, version=5)
    share = len(records) // 2
    layout = MicroBatchLayout(mode, micro_batch_size=2, max_tokens=32, seq_multiple=8)
    minis, longest = build_minibatches(records[rank * share:(rank + 1) * share], layout, share // 2,
                                       lambda first, dp_rank: 100 * first + 10 * dp_rank, groups.dp)
    return minis, longest
