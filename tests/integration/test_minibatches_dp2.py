"""Tier a and b: the sequence record (`batch.records`) and the one micro-batch builder: the
multi-process and end-to-end tests (the single-process ones are in
``tests/batch/test_minibatches.py``)."""

import pytest
from stapo_megatron.batch.minibatches import MicroBatchLayout, pack_planned, plan_budget
from stapo_megatron.batch.records import decode, encode, encoded_size, make_records, record, records_from_lists
from tests.helpers.dist_utils import run_distributed
from tests.helpers.minibatch_records import _budget_worker, _records, _same_microbatch  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "budget"])
def test_dp2_builds_what_one_process_plans(mode):
    """8 records per DP rank in 2 mini-batches: on each rank the micro-batches equal those a single
    process packs from all ranks' records under the same plan (the budget plan moves records
    between ranks; "fixed" keeps each rank's own), routes and advantages bit for bit."""
    lengths = [(3, 5), (2, 20), (6, 15), (1, 3), (4, 4), (2, 9), (3, 3), (5, 1),
               (2, 2), (7, 14), (1, 1), (3, 12), (2, 6), (4, 18), (6, 2), (1, 9)]
    records = _records(lengths, seed=3, routes=True, version=5)
    results = run_distributed(2, _budget_worker, lengths, mode)
    layout = MicroBatchLayout(mode, micro_batch_size=2, max_tokens=32, seq_multiple=8)
    moved = False
    for m, start in enumerate((0, 4)):
        # mini-batch m: rank 0's records start..start+3 then rank 1's, in rank order
        mini = records[start:start + 4] + records[8 + start:8 + start + 4]
        if mode == "budget":
            plan = plan_budget([r.length for r in mini], layout, num_ranks=2, seed=100 * start)
        else:
            plan = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        for rank, (minis, longest) in enumerate(results):
            want = pack_planned(mini.__getitem__, plan[rank], layout, 100 * start)
            assert len(minis[m]) == len(want) > 0
            for got, ref in zip(minis[m], want):
                _same_microbatch(got, ref)
            moved |= any(g // 4 != rank for mb in plan[rank] for g in mb)
    assert moved == (mode == "budget"), "the budget plan must train some records on another rank"
    for minis, longest in results:
        assert longest == max(mb.tokens.shape[1] for mini in minis for mb in mini)
