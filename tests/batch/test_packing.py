"""Tier a: packed (THD) micro-batches and the token-budget plan.

A packed row of sequences through the model (`SDPAttention`'s reference path, Megatron's THD
RoPE) equals each sequence run alone; the packed fields equal the padded rows' fields token by
token; the budget plan fits, balances and is fixed by its seed; bad input names its numbers.

Tolerances (fp32, CPU): logits ATOL 2e-5 at O(1)-O(5) logits, gradients 2e-5 relative to each
parameter's largest entry -- the same per-sequence softmax(QK^T/sqrt(d))V, only the matmuls see
a different number of rows (summation order; measured ~1e-6).
"""

import pytest
import torch

from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.batch.microbatch import MicroBatch, pack_sequences
from stapo_megatron.batch.packing import imbalance, pack_thd, plan_fixed_count, plan_token_budget, sequence_ids
from stapo_megatron.batch.records import records_from_lists
from tests.helpers.engine_parity import randomize

LOGIT_ATOL = 2e-5
GRAD_RTOL = 2e-5


def _rollouts(lengths, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    adv = torch.randn(len(lengths), generator=gen).tolist()
    lps = [(-torch.rand(r, generator=gen)).tolist() for _, r in lengths]
    return prompts, responses, adv, lps


def test_packed_fields_equal_padded_rows():
    lengths = [(3, 5), (6, 1), (2, 9)]
    prompts, responses, adv, lps = _rollouts(lengths)
    padded = pack_sequences(records_from_lists(prompts, responses, adv, lps), pad_id=0, seq_length=16)
    packed = pack_thd(records_from_lists(prompts, responses, adv, lps), pad_id=0, align=8)
    total = sum(p + r for p, r in lengths)  # 26, aligned to 32: the tail is a sequence of its own
    assert packed.tokens.shape == (1, 32) and packed.cu_seqlens.tolist() == [0, 8, 15, 26, 32]
    bounds = packed.cu_seqlens.tolist()
    assert packed.max_seqlen == 11
    for i, (p, r) in enumerate(lengths):
        a, n = bounds[i], p + r
        for field in ("tokens", "labels", "response_mask", "advantages", "rollout_logprob"):
            assert torch.equal(getattr(packed, field)[0, a:a + n], getattr(padded, field)[i, :n]), field
        assert packed.position_ids[0, a:a + n].tolist() == list(range(n))
    assert not packed.response_mask[0, total:].any()
    assert sequence_ids(packed.cu_seqlens).tolist() == [0] * 8 + [1] * 7 + [2] * 11 + [3] * 6


def test_packed_microbatch_errors():
    row = torch.zeros(1, 10, dtype=torch.long)
    fields = dict(tokens=row, position_ids=row, labels=row, response_mask=row.bool())
    with pytest.raises(ValueError, match=r"rise strictly from 0 to the packed length 10, got \[0, 4, 8\]"):
        MicroBatch(**fields, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32), max_seqlen=4)
    with pytest.raises(ValueError, match="max_seqlen 3 != the longest sequence of cu_seqlens 6"):
        MicroBatch(**fields, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=3)
    with pytest.raises(ValueError, match="one row"):
        MicroBatch(**fields, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=6).rows(0, 1)


def test_token_budget_plan():
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 400, (64,), generator=gen).tolist()
    plan = plan_token_budget(lengths, max_tokens=1024, num_ranks=2, seed=5)
    assert plan == plan_token_budget(lengths, max_tokens=1024, num_ranks=2, seed=5)  # the seed fixes it
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(64))  # every sequence once
    assert len(plan[0]) == len(plan[1])  # the same number of micro-batches on every rank
    assert all(sum(lengths[i] for i in mb) <= 1024 for rank in plan for mb in rank)
    assert len(plan[0]) * 2 * 1024 < sum(lengths) + 2 * 1024  # the fewest that fit, give or take one per rank
    assert imbalance(plan, lengths) <= 1.05
    assert plan_fixed_count(8, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_token_budget_errors():
    with pytest.raises(ValueError, match="sequence 1 has 300 tokens .* > max_tokens_per_microbatch 256"):
        plan_token_budget([100, 300, 20], max_tokens=256)
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"max_tokens_per_microbatch must be > 0, got {bad}"):
            plan_token_budget([10], max_tokens=bad)


def _logits_and_grads(model, batch):
    from stapo_megatron.mcore.schedule import packed_seq_params

    model.zero_grad()
    out = model(batch.tokens, batch.position_ids, attention_mask=None, packed_seq_params=packed_seq_params(batch))
    return out


@pytest.mark.parametrize("variant", ["qwen3", "qwen2.5"])
def test_packed_attention_equals_each_sequence_alone(parallel, variant):
    from stapo_megatron.bridge import build_gpt_model

    model = build_gpt_model(tiny_config(variant), core_attention="sdpa")
    randomize(model, seed=3)
    lengths = [(5, 11), (9, 3), (4, 20)]
    prompts, responses, adv, lps = _rollouts(lengths, vocab=tiny_config(variant)["vocab_size"])
    packed = pack_thd(records_from_lists(prompts, responses, adv, lps), pad_id=0, align=8)
    out = _logits_and_grads(model, packed)
    assert out.shape[:2] == (1, packed.tokens.shape[1])
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    upstream[:, sum(p + r for p, r in lengths):] = 0  # the alignment tail has no loss
    out.backward(upstream)
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bounds = packed.cu_seqlens.tolist()
    for i in range(len(lengths)):
        a, b = bounds[i], bounds[i + 1]
        alone = model(packed.tokens[:, a:b], torch.arange(b - a)[None], attention_mask=None)
        assert out[:, a:b].abs().max() > 1.0
        torch.testing.assert_close(out[:, a:b], alone, atol=LOGIT_ATOL, rtol=0)
        alone.backward(upstream[:, a:b])
    for (name, p), g in zip(model.named_parameters(), packed_grads):
        assert (g - p.grad).abs().max() <= GRAD_RTOL * p.grad.abs().max(), name


def test_grpo_sequence_mean_packed_equals_padded():
    """GRPO's per-sequence mean: a packed row counts its sequences, not its one row."""
    from stapo_megatron.method.objective import PolicyLossConfig, PolicyTokens, policy_loss

    lengths = [(3, 5), (6, 1), (2, 9)]
    prompts, responses, adv, lps = _rollouts(lengths)
    padded = pack_sequences(records_from_lists(prompts, responses, adv, lps), pad_id=0, seq_length=16)
    packed = pack_thd(records_from_lists(prompts, responses, adv, lps), pad_id=0, align=8)
    gen = torch.Generator().manual_seed(4)
    logp_pad = -torch.rand(padded.tokens.shape, generator=gen)
    bounds = packed.cu_seqlens.tolist()
    logp_pack = torch.zeros(packed.tokens.shape)
    for i, (p, r) in enumerate(lengths):
        logp_pack[0, bounds[i]:bounds[i] + p + r] = logp_pad[i, :p + r]
    def loss(b, lp, ids=None):  # noqa: E306
        return policy_loss(PolicyTokens(lp, b.rollout_logprob, b.advantages, b.response_mask,
                                        torch.zeros_like(b.response_mask), sequence_ids=ids),
                           PolicyLossConfig(loss_agg="seq_mean_token_mean"))
    want = loss(padded, logp_pad)
    got = loss(packed, logp_pack, sequence_ids(packed.cu_seqlens)[None])
    assert int(got[1]) == int(want[1]) == 3
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)  # fp32 sums in another order


def test_config_packing_errors():
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.data.config import DataConfig
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.mcore.config import ModelConfig

    short = dict(data=DataConfig(max_prompt_len=100), rollout=RolloutSampling(max_response_len=200))
    with pytest.raises(ValueError, match="max_tokens_per_microbatch must be > 0 with packing='budget', got 0"):
        TrainerConfig(packing="budget", **short)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch 256 < the longest sequence .* = 100 \+ 200 = 300"):
        TrainerConfig(packing="budget", max_tokens_per_microbatch=256, **short)
    with pytest.raises(ValueError, match="packing must be one of"):
        TrainerConfig(packing="thd")
    with pytest.raises(ValueError, match="not supported with pipeline parallelism yet"):
        TrainerConfig(packing="fixed", model=ModelConfig(pipeline_model_parallel_size=2))
    assert TrainerConfig(packing="budget", max_tokens_per_microbatch=300, **short).packing == "budget"
