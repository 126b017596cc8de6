"""Context parallelism, single-process (tier a): the split of packed rows over CP ranks and back,
its errors, and the configs and loss that refuse unsupported CP settings. The CP attention, the
training updates, checkpoints and evaluation at CP=2 against CP=1 run on gloo in
``tests/integration/test_context_parallel_training.py``.

Tolerances: the split is exact (integer indexing).
"""

import pytest
import torch

from stapo_megatron.batch.alignment import sequence_multiple
from stapo_megatron.batch.context_parallel import local_positions, split_for_context_parallel, unsplit
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.packing import pack_thd
from stapo_megatron.batch.records import record, records_from_lists
from tests.helpers.context_parallel_workers import VOCAB, _rollouts

FIELDS = ("tokens", "position_ids", "labels", "response_mask", "advantages", "rollout_logprob")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_split_round_trip_chunks_and_padding(cp):
    prompts, responses, adv, lps = _rollouts()
    seq_align = sequence_multiple(cp)
    whole = pack_thd(records_from_lists(prompts[:5], responses[:5], adv[:5], lps[:5]), pad_id=0, align=8 * seq_align, seq_align=seq_align,
                     seed=5)
    unpadded = pack_thd(records_from_lists(prompts[:5], responses[:5], adv[:5], lps[:5]), pad_id=0)
    bounds, plain = whole.cu_seqlens.tolist(), unpadded.cu_seqlens.tolist()
    for i in range(5):  # each sequence: its real tokens as without CP, then padding without loss
        a, n, L = bounds[i], plain[i + 1] - plain[i], bounds[i + 1] - bounds[i]
        assert L % (2 * cp) == 0 and L - n < 2 * cp
        for f in FIELDS:
            assert torch.equal(getattr(whole, f)[0, a:a + n], getattr(unpadded, f)[0, plain[i]:plain[i] + n]), f
        assert not whole.response_mask[0, a + n:a + L].any()
        assert whole.position_ids[0, a:a + L].tolist() == list(range(L))  # global within the sequence
    parts = [split_for_context_parallel(whole, cp, r) for r in range(cp)]
    for r, part in enumerate(parts):
        assert part.tokens.shape[1] * cp == whole.tokens.shape[1] and part.cp_size == cp
        assert torch.equal(part.cu_seqlens, whole.cu_seqlens) and part.max_seqlen == whole.max_seqlen
        # chunks r and 2 cp - 1 - r of the first sequence, in that order
        c = bounds[1] // (2 * cp)
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert local_positions(whole.cu_seqlens, cp, r)[:2 * c].tolist() == want
    assert len({p.seed for p in parts}) == cp and parts[0].seed == 5  # the random controls draw per rank
    for f in FIELDS:  # un-splitting the ranks' pieces gives the packed row back
        assert torch.equal(unsplit([getattr(p, f) for p in parts], whole.cu_seqlens), getattr(whole, f)), f


def test_split_errors():
    prompts, responses, adv, lps = _rollouts()
    packed = pack_thd([record([1, 2, 3], [4, 5, 6], 1.0, [-0.1] * 3)], pad_id=0)  # 6 tokens: not 4 chunks
    with pytest.raises(ValueError, match="does not split into 2 x context_parallel_size 2 chunks"):
        split_for_context_parallel(packed, 2, 0)
    with pytest.raises(ValueError, match="cp_rank 2 out of range for context_parallel_size 2"):
        split_for_context_parallel(packed, 2, 2)
    with pytest.raises(ValueError, match="seq_align must divide align"):
        pack_thd(records_from_lists(prompts[:2], responses[:2], adv[:2], lps[:2]), pad_id=0, align=6, seq_align=4)
    with pytest.raises(ValueError, match="context_parallel_size 2 needs packed micro-batches"):
        MicroBatchLayout("padded", micro_batch_size=2, cp_size=2)
    records = records_from_lists(prompts, responses, adv, lps)
    longest = max(r.length for r in records)
    with pytest.raises(ValueError, match=r"> max_tokens_per_microbatch 8 x context_parallel_size 2 = 16"):
        build_minibatches(records, MicroBatchLayout("budget", max_tokens=8, cp_size=2, seq_align=4))
    # a sequence longer than one rank's budget trains when CP splits it
    budget = -(-longest // 4) * 2
    assert budget < longest
    (mbs,), _ = build_minibatches(records, MicroBatchLayout("budget", max_tokens=budget, cp_size=2, cp_rank=1, seq_align=4,
                                                       seq_multiple=8))
    assert all(mb.tokens.shape[1] <= budget and mb.cp_size == 2 for mb in mbs)
    assert sum(int(mb.response_mask.sum()) for mb in mbs) > 0


def test_config_refuses_unsupported_context_parallel():
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.mcore.config import ModelConfig

    cp2 = ModelConfig(context_parallel_size=2)
    with pytest.raises(ValueError, match="context_parallel_size 2 needs packed micro-batches: packing='fixed'"):
        TrainerConfig(model=cp2, packing="padded")
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch 100 < the longest sequence .* over context_parallel_size 2 = \d+ tokens per rank"):
        TrainerConfig(model=cp2, packing="budget", max_tokens_per_microbatch=100)
    defaults = TrainerConfig()
    half = (defaults.data.max_prompt_len + defaults.rollout.max_response_len) // 2
    TrainerConfig(model=cp2, packing="budget", max_tokens_per_microbatch=half)  # each CP rank holds half
    with pytest.raises(ValueError, match="context_parallel_size 2 with pipeline_model_parallel_size 2"):
        ModelConfig(context_parallel_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="model.cp_comm_type must be one of"):
        ModelConfig(cp_comm_type="ring")
    # "a2a+p2p" needs hierarchical CP groups that mcore.parallel does not build
    with pytest.raises(ValueError, match=r'cp_comm_type "a2a\+p2p" needs hierarchical context-parallel groups'):
        ModelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p")
    assert ModelConfig(context_parallel_size=2, cp_comm_type="a2a").context_parallel_settings()["cp_comm_type"] == "a2a"
    assert cp2.context_parallel_settings() == dict(context_parallel_size=2, cp_comm_type="p2p")
    assert ModelConfig().context_parallel_settings() == {}


def test_loss_func_needs_the_cp_group_of_a_split_batch():
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.loss import loss_func

    prompts, responses, adv, lps = _rollouts()
    packed = pack_thd(records_from_lists(prompts[:2], responses[:2], adv[:2], lps[:2]), pad_id=0, align=8, seq_align=4)
    part = split_for_context_parallel(packed, 2, 0)
    part.old_logprob = part.rollout_logprob
    logits = torch.zeros(part.tokens.shape[1], 1, VOCAB)
    with pytest.raises(ValueError, match="split over 2 context-parallel ranks but loss_func's cp_group has 1"):
        loss_func(LossConfig(method="justrl"), part, torch.tensor(float("nan")), None, None, logits)
