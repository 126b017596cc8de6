"""Tier b: LoRA adapters at TP = 2 (with and without sequence parallelism) equal TP = 1 (gloo, real
megatron-core): logits, the gradients of A and B gathered to full size, the optimizer's gradient norm, the
merged HF tensors the weight sync streams (merge-on-sync, bit for bit); and the adapted model's checkpoint
resharded from TP = 1 to TP = 2."""

import pytest
import torch

from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.slow

LOGIT_TOL = 5e-6
"""fp32 logits <= 1: TP only reorders the sums of the matmuls and of the all-reduces (measured 6e-7)."""
GRAD_RTOL = 2e-5
"""fp32 gradients, relative to each tensor's largest entry: the same reordered sums over a backward (measured 2e-6)."""


def _worker(tp, sequence_parallel, ckpt_dir):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import finalize_model_grads

    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.lora import adapters_disabled, apply_lora
    from stapo_megatron.mcore.lora_config import LoraConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.step import build_optimizer, wrap_ddp
    from tests.helpers.lora_models import VOCAB, forward, full_adapter_weights, tiny_gpt, tokens

    groups = init_parallel(tp, 1)
    model = tiny_gpt(tp, sequence_parallel)
    adapters = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    hand = {name: full_adapter_weights(name, a.full_shapes) for name, a in adapters.items()}  # B != 0: A gets a grad
    # the same adapted model at every layout: TP=1 sets the adapters by hand and saves base and adapters,
    # TP=2 loads them resharded (the gated fc1's B as its weight); it must hold what load_full_ shards
    if tp == 1:
        for name, adapter in adapters.items():
            adapter.load_full_(*hand[name])
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
        for name, adapter in adapters.items():
            loaded = adapter.A.detach().clone(), adapter.B.detach().clone()
            adapter.load_full_(*hand[name])
            assert torch.equal(loaded[0], adapter.A) and torch.equal(loaded[1], adapter.B), name
            full = adapter.gather_full(adapter.A.detach(), adapter.B.detach())
            assert torch.equal(full[0], hand[name][0]) and torch.equal(full[1], hand[name][1]), name
    ddp = wrap_ddp(model)
    # merge-on-sync: the HF tensors the engine gets, W0 + s B A merged on each TP shard before the gather
    from stapo_megatron.rollout.weight_sync import iter_hf_weights

    streamed = {name: t.clone() for name, t in iter_hf_weights(ddp, model.qwen_spec, groups)}
    optimizer = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0))
    tp_rank, shard = dist.get_rank(groups.tp), VOCAB // tp
    weight = torch.randn(2, 16, VOCAB, generator=torch.Generator().manual_seed(3))[..., tp_rank * shard:][..., :shard]
    logits = forward(ddp, tokens())
    (logits * weight).sum().backward()  # the vocabulary-parallel sum: each rank its shard's part
    finalize_model_grads([ddp])  # DP (size 1) and, under SP, the TP all-reduce of `sequence_parallel` grads
    with torch.no_grad(), adapters_disabled(ddp):
        base = forward(ddp, tokens())

    def gather_vocab(x):
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x.contiguous(), group=groups.tp)
        return torch.cat(parts, dim=-1)

    grads, replicated = {}, {}
    for name, adapter in adapters.items():
        grads[name] = adapter.gather_full(adapter.A.main_grad, adapter.B.main_grad)
        replicated[name] = (adapter.A if adapter.parallel == "column" else adapter.B).main_grad.clone()
    optimizer.prepare_grads()
    num_params = sum(len(g["params"]) for g in optimizer.param_groups)
    # dropout on the adapters' inputs: split inputs draw from the model-parallel RNG (forked here)
    for adapter in adapters.values():
        adapter.dropout = torch.nn.Dropout(0.5)
    with torch.no_grad():
        assert ddp.training and not torch.equal(forward(ddp, tokens()), logits.detach())
        for kind in ("column", "row"):  # the same mask on every TP rank only for a replicated input
            kept = next(a for a in adapters.values() if a.parallel == kind)._dropout(torch.ones(8, 2, 16)) != 0
            masks = [torch.empty_like(kept) for _ in range(tp)]
            dist.all_gather(masks, kept, group=groups.tp)
            assert torch.equal(masks[0], masks[-1]) == (tp == 1 or (kind == "column" and not sequence_parallel))
    return (gather_vocab(logits.detach()), gather_vocab(base), grads, replicated, float(optimizer.get_grad_norm()),
            num_params, streamed)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("lora_base"))
    return run_distributed(1, _worker, 1, False, ckpt)[0], ckpt


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_equals_tp1(tp1, sequence_parallel):
    (logits, base, grads, _, grad_norm, num_params, streamed), ckpt = tp1
    assert num_params == 16, "the optimizer holds A and B of the 8 adapters, nothing of the base"
    assert float((logits - base).abs().max()) > 1000 * LOGIT_TOL, "the adapters move the logits"
    ranks = run_distributed(2, _worker, 2, sequence_parallel, ckpt)
    for got_logits, got_base, got_grads, replicated, got_norm, got_params, got_streamed in ranks:
        assert sorted(got_streamed) == sorted(streamed)
        for name, tensor in streamed.items():  # each element the same r-long dot product at any TP
            assert torch.equal(got_streamed[name], tensor), name
        torch.testing.assert_close(got_logits, logits, atol=LOGIT_TOL, rtol=0)
        torch.testing.assert_close(got_base, base, atol=LOGIT_TOL, rtol=0)
        assert got_params == num_params
        assert got_norm == pytest.approx(grad_norm, rel=GRAD_RTOL), "replicated adapters counted once"
        for name, (grad_a, grad_b) in grads.items():
            for got, want in zip(got_grads[name], (grad_a, grad_b)):
                assert got.shape == want.shape and float(want.abs().max()) > 0, name
                torch.testing.assert_close(got, want, atol=GRAD_RTOL * float(want.abs().max()), rtol=0, msg=name)
    for name in grads:  # the replicated A (column) or B (row): one gradient on every TP rank
        assert torch.equal(ranks[0][3][name], ranks[1][3][name]), name
