"""Tier a and b: the sequence record (`batch.records`) and the one micro-batch builder
(`batch.minibatches.build_minibatches`) of every layout.

Tier a: a record's bytes round-trip bit for bit; the padded layout is the trainer's (rows padded to
the longest of this rank's records, seeds ``microbatch_seed(first, dp_rank) + row``); "fixed"
packs the padded micro-batches' sequences; bad input names its numbers.
Tier b (gloo, 2 ranks): the "budget" exchange gives each rank exactly the records it trains
(tokens, log-probs, advantage, version, routes bit for bit) and nothing else; at DP=2 every
layout builds on each rank what a single process builds from all ranks' records.
"""

import dataclasses

import pytest
import torch

from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.records import decode, encode, encoded_size, make_records, record, records_from_lists
from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.rollout.base import Sample
from tests.helpers.minibatch_records import K, L, _records, _same_record


def test_record_bytes_round_trip():
    for rec in _records([(3, 5), (1, 1), (7, 2)], routes=True, version=12) + _records([(4, 4)]):
        data = encode(rec, rec.routes is not None)
        shape = None if rec.routes is None else (L, K)
        sizes = len(rec.prompt_ids), len(rec.response_ids)
        assert data.dtype == torch.uint8 and len(data) == encoded_size(*sizes, shape)
        _same_record(rec, decode(data, *sizes, shape))
    # a chunk at an odd offset of a received buffer decodes as well
    rec = _records([(3, 5)], routes=True)[0]
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), encode(rec, True)])
    _same_record(rec, decode(buffer[3:], 3, 5, (L, K)))


def test_make_records_flattens_groups_and_sets_the_version():
    prompts = [(10, [1, 2]), (11, [3])]
    groups = [[_sample([4]), _sample([5, 6])], [_sample([7, 8, 9]), _sample([10])]]
    rollout = StepRollout.of_groups(5, prompts, lambda i: str(i), groups, 2, version=3)
    records = make_records(rollout, torch.tensor([[0.5, -0.5], [1.0, -1.0]]), updates_per_step=2)
    assert [r.prompt_ids.tolist() + r.response_ids.tolist() for r in records] == [[1, 2, 4], [1, 2, 5, 6],
                                                                                    [3, 7, 8, 9], [3, 10]]
    # version: the request's policy (3 steps trained) x 2 updates a step
    assert [r.advantage for r in records] == [0.5, -0.5, 1.0, -1.0] and {r.version for r in records} == {6}
    assert all(r.loss_mask is None and r.routes is None for r in records)
    with pytest.raises(ValueError, match="3 advantages for 4 samples"):
        make_records(rollout, torch.zeros(3), updates_per_step=1)
    with pytest.raises(dataclasses.FrozenInstanceError):  # built complete, never changed
        records[0].version = 0


def _sample(ids, versions=None):
    return Sample(token_ids=ids, logprobs=[-0.25] * len(ids), text="", finish_reason="stop", versions=versions)


def test_make_records_of_partial_rollouts_take_the_oldest_version_and_mask_tokens_past_the_bound():
    """A response continued over steps 1..3 (token versions 1, 1, 2, 3) trains at step 4 with a
    token-level bound of 2 steps: its version is its oldest token's, and the tokens older than
    step 4 - 2 = 2 are left out of the loss; a response of one policy keeps every token."""
    groups = [[_sample([4, 5, 6, 7], versions=[1, 1, 2, 3]), _sample([8, 9], versions=[3, 3])]]
    rollout = StepRollout.of_groups(4, [(0, [1, 2])], lambda i: "", groups, 2)
    assert rollout.version == 1  # the step's oldest token
    records = make_records(rollout, torch.zeros(1, 2), updates_per_step=3, token_age_bound=2)
    assert [r.version for r in records] == [3, 9]
    assert records[0].loss_mask.tolist() == [False, False, True, True] and records[1].loss_mask is None
    unbounded = make_records(rollout, torch.zeros(1, 2), updates_per_step=3)
    assert all(r.loss_mask is None for r in unbounded)


def test_record_errors():
    with pytest.raises(ValueError, match="sequence 1: 1 rollout log-probs for 2 response tokens"):
        records_from_lists([[1], [2]], [[3], [4, 5]], [0.0, 0.0], [[0.0], [0.0]])
    with pytest.raises(ValueError, match=r"prompt_ids must be \[P >= 1\], got \(0,\)"):
        record([], [1], 0.0, [0.0])
    with pytest.raises(ValueError, match="packing must be one of"):
        MicroBatchLayout("thd")
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        MicroBatchLayout("padded", micro_batch_size=0)
    with pytest.raises(ValueError, match="6 records do not split into mini-batches of 4"):
        build_minibatches(_records([(2, 2)] * 6), MicroBatchLayout("padded"), minibatch_size=4)


def test_padded_layout_is_the_trainers():
    """Two mini-batches of 4 records: rows padded to the longest of ALL this rank's records
    (21 -> 24), micro-batches of 2 rows seeded ``microbatch_seed(first, dp_rank) + row``."""
    records = _records([(3, 5), (2, 2), (6, 15), (1, 3), (4, 4), (2, 9), (3, 3), (5, 1)])
    seeds = []
    minis, seq = build_minibatches(records, MicroBatchLayout("padded", micro_batch_size=2, seq_multiple=8), 4,
                                   lambda first, dp_rank: seeds.append((first, dp_rank)) or 1000 * first + 7)
    assert seq == 24 and seeds == [(0, 0), (4, 0)]
    assert [[mb.seed for mb in mini] for mini in minis] == [[7, 9], [4007, 4009]]
    assert all(mb.tokens.shape == (2, 24) and not mb.is_packed for mini in minis for mb in mini)
    row = minis[1][1]  # records 6 and 7
    assert row.tokens[1, :6].tolist() == records[7].prompt_ids.tolist() + records[7].response_ids.tolist()
    assert (row.advantages[1] == records[7].advantage).all()  # the padded layout's advantage fills the row
    assert row.response_mask[1].nonzero().flatten().tolist() == [4]


def test_fixed_layout_packs_the_padded_microbatches():
    records = _records([(3, 5), (2, 2), (6, 15), (1, 3)], routes=True)
    (padded,), _ = build_minibatches(records, MicroBatchLayout("padded", micro_batch_size=2))
    (fixed,), longest = build_minibatches(records, MicroBatchLayout("fixed", micro_batch_size=2, seq_multiple=8))
    assert [mb.seed for mb in fixed] == [0, 2] and longest == 32
    for pad, pack in zip(padded, fixed):
        bounds = pack.cu_seqlens.tolist()
        for i in range(2):
            n = (pack.cu_seqlens[i + 1] - pack.cu_seqlens[i]).item()
            for f in ("tokens", "labels", "response_mask", "rollout_logprob", "advantages", "routes"):
                assert torch.equal(getattr(pack, f)[0, bounds[i]:bounds[i] + n], getattr(pad, f)[i, :n]), f


def test_a_records_loss_mask_reaches_its_response_mask_and_survives_the_byte_exchange():
    """Partial rollouts leave stale tokens out of the loss through ``SequenceRecord.loss_mask``:
    the token fields drop them from the response mask, and the budget layout's byte exchange
    (`records.encode` / `decode`) carries the mask."""
    import torch

    from stapo_megatron.batch.records import decode, encode, encoded_size, record, token_fields

    rec = record([5, 6, 7], [8, 9, 10, 11], 0.5, [-0.1, -0.2, -0.3, -0.4], version=3,
                 loss_mask=torch.tensor([False, False, True, True]))
    fields = token_fields(rec, 0, with_routes=False)
    # the labels of positions 2..5 are the response tokens; the first two are left out
    assert fields.response_mask.tolist() == [False, False, False, False, True, True, False]
    data = encode(rec, with_routes=False)
    assert data.numel() == encoded_size(3, 4, None)
    back = decode(data, 3, 4, None)
    assert back.loss_mask.tolist() == [False, False, True, True] and back.version == 3
    whole = record([5], [8, 9], 0.0, [-0.1, -0.2])
    assert decode(encode(whole, False), 1, 2, None).loss_mask is None  # all kept: no mask
