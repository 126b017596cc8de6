"""Tier a: the step's overlap of S2T's selection with the mismatch-flagged tokens, summed over its
mini-batch updates (counts, fractions of silenced / candidate / kept tokens), by hand."""

import math

from stapo_megatron.trainer.mismatch_metrics import overlap_metrics

KEYS = ("silenced_count", "candidate_count", "num_kept", "mismatch_flagged_count", "silenced_flagged_count",
        "candidates_flagged_count", "correction_rejected_count", "num_response_tokens", "is_weight_sum",
        "is_truncated_count")


def _update(**counts):
    return {key: counts.get(key, 0) for key in KEYS}


def test_overlap_sums_the_updates_before_dividing():
    updates = [_update(silenced_count=4, candidate_count=10, num_kept=30, mismatch_flagged_count=5,
                       silenced_flagged_count=1, candidates_flagged_count=2, correction_rejected_count=3,
                       num_response_tokens=40, is_weight_sum=27.0, is_truncated_count=1),
               _update(silenced_count=0, candidate_count=6, num_kept=10, mismatch_flagged_count=2,
                       silenced_flagged_count=0, candidates_flagged_count=2, correction_rejected_count=1,
                       num_response_tokens=10, is_weight_sum=11.0, is_truncated_count=3)]
    got = overlap_metrics(updates)
    assert got == dict(mismatch_flagged_count=7, silenced_flagged_count=1, silenced_flagged_fraction=1 / 4,
                       candidates_flagged_count=4, candidates_flagged_fraction=4 / 16,
                       correction_rejected_fraction=4 / 50, is_weight_mean=38.0 / 40, is_truncated_fraction=4 / 40)


def test_nothing_silenced_or_kept_is_nan_not_zero():
    got = overlap_metrics([_update(num_response_tokens=0)])
    assert math.isnan(got["silenced_flagged_fraction"]) and math.isnan(got["candidates_flagged_fraction"])
    assert math.isnan(got["is_weight_mean"]) and math.isnan(got["is_truncated_fraction"])
    assert got["correction_rejected_fraction"] == 0.0  # over max(tokens, 1): no division by zero
