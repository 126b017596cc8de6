"""Qwen3.5's delta-net layers under context parallelism: the gloo worker of
``tests/integration/test_delta_net_context_parallel.py``. In the same processes, the tiny
Qwen3.5 (`bridge.tiny`, 3 delta-net layers and one gated full-attention layer) runs one packed
row at CP=1 (every rank the whole row), then, with the same weights, at CP=2 (each rank its
`batch.context_parallel.local_positions`): logits, a per-token loss and every parameter's
gradient of both come back for the test to compare."""

import torch

LENGTHS = (12, 20, 8)
"""The packed row's sequences: each a multiple of 2 x CP = 4 tokens (`packing.pack_thd`'s ``seq_align``)."""


def _row(vocab: int):
    """tokens [1, T], positions [1, T] (restarting per sequence), cu_seqlens, and per-token loss
    weights [T] (fixed, so the loss is a weighted sum of the label log-probs)."""
    gen = torch.Generator().manual_seed(11)
    total = sum(LENGTHS)
    tokens = torch.randint(1, vocab, (1, total), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    labels = torch.randint(1, vocab, (1, total), generator=gen)
    weights = torch.rand(total, generator=gen)
    return tokens, positions, cu, labels, weights


def _forward_backward(model, tokens, positions, cu, labels, weights):
    """The model on one (possibly CP-split) packed row with the global ``cu_seqlens``: logits
    [t, V] and the gradient of sum_t weight_t * log p(label_t)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    model.zero_grad()
    logits = model(tokens, positions, attention_mask=None, packed_seq_params=params)[0]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[0, :, None])[:, 0]
    (logp * weights).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _checkpoint_shards(model) -> dict:
    """key -> (global shape, global offset, local shape) of every tensor the model's sharded state
    dict saves (megatron-core's factories applied: the delta net's in_proj and conv1d pieces)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    return {v.key: (tuple(v.global_shape), tuple(v.global_offset), tuple(v.data.shape))
            for v in nested_values(sharded) if isinstance(v, ShardedTensor)}


def delta_net_cp_worker():
    """CP=1 then CP=2 on the same row and weights. Returns this rank's CP=1 logits and gradients,
    its CP=2 logits with the positions they hold, the CP=2 gradients summed over the CP group
    (as Megatron's DP x CP gradient all-reduce sums them), and at each CP size the shards the
    checkpoint would save (`_checkpoint_shards`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stapo_megatron.batch.context_parallel import local_positions
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.mcore.parallel import init_parallel

    spec = tiny_config("qwen3.5")
    tokens, positions, cu, labels, weights = _row(spec["vocab_size"])
    out = {}
    state = None
    for cp in (1, 2):
        groups = init_parallel(1, 1, context_parallel_size=cp)
        model = build_gpt_model(spec, params_dtype=torch.float32, parallel_output=False, core_attention="sdpa")
        if state is None:
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])
        idx = local_positions(cu, cp, dist.get_rank(groups.cp)) if cp > 1 else torch.arange(int(cu[-1]))
        logits, grads = _forward_backward(model, tokens[:, idx], positions[:, idx], cu, labels[:, idx], weights[idx])
        if cp > 1:
            for g in grads.values():
                dist.all_reduce(g, group=groups.cp)
        out[cp] = dict(logits=logits, grads=grads, idx=idx, checkpoint=_checkpoint_shards(model))
        parallel_state.destroy_model_parallel()
    return out
