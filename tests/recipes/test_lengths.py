"""The cost model's lengths: the capped log-normal's moments in closed form against its quantile
samples, and the paper's regime."""

import pytest

from stapo_megatron.recipes.lengths import PAPER_LENGTHS
from stapo_megatron.recipes import step_model


def test_the_length_moments_match_their_quantiles():
    lengths = PAPER_LENGTHS
    q = lengths.quantile_responses(100_000)
    assert lengths.mean_response() == pytest.approx(4221.8, abs=0.1)
    assert sum(q) / len(q) == pytest.approx(lengths.mean_response(), rel=1e-3)
    assert sum(x * x for x in q) / len(q) == pytest.approx(lengths.response_moment(2), rel=1e-3)
    assert max(q) == 15360 and min(q) >= 1
    assert lengths.mean_prompt == 562.0
    with pytest.raises(ValueError, match="mean response"):
        lengths.with_mean_response(20000)
    assert lengths.with_mean_response(3000.0).mean_response() == pytest.approx(3000.0, rel=1e-6)
    assert step_model.PAPER_LENGTHS is PAPER_LENGTHS  # the cost model reads these
