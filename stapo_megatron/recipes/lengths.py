"""The response and prompt lengths of a step for the cost model (`stapo_megatron.recipes.step_model`)
and the rollout-schedule simulator: prompts uniform in a range, responses log-normal and capped,
their capped moments in closed form and deterministic quantile samples."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import List, Tuple


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Prompts uniform in ``prompt_range``; responses log-normal (``response_median``,
    ``response_sigma``) capped at ``response_cap`` tokens."""

    prompt_range: Tuple[int, int]
    response_median: float
    response_sigma: float
    response_cap: int

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_range) / 2

    def mean_response(self) -> float:
        """E[min(X, cap)] of the log-normal X."""
        return self.response_moment(1)

    def response_moment(self, k: int) -> float:
        """E[min(X, cap)^k] of the log-normal X (k = 1 or 2)."""
        mu, s, c = math.log(self.response_median), self.response_sigma, self.response_cap
        return (math.exp(k * mu + k * k * s * s / 2) * _phi((math.log(c) - mu - k * s * s) / s)
                + c ** k * (1 - _phi((math.log(c) - mu) / s)))

    def with_mean_response(self, mean: float) -> "Lengths":
        """The same shape with the median that gives a capped mean of ``mean`` tokens."""
        if not 0 < mean < self.response_cap:
            raise ValueError(f"mean response {mean} must lie in (0, response_cap={self.response_cap})")
        lo, hi = 1.0, float(self.response_cap) * 10
        for _ in range(100):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if dataclasses.replace(self, response_median=mid).mean_response() < mean else (lo, mid)
        return dataclasses.replace(self, response_median=math.sqrt(lo * hi))

    def quantile_responses(self, n: int) -> List[int]:
        """``n`` response lengths at the quantiles (i + 0.5) / n: a deterministic stand-in for a sample."""
        normal = statistics.NormalDist(math.log(self.response_median), self.response_sigma)
        return [min(self.response_cap, max(1, int(math.exp(normal.inv_cdf((i + 0.5) / n))))) for i in range(n)]


PAPER_LENGTHS = Lengths((100, 1024), response_median=3000, response_sigma=0.9, response_cap=15360)
"""The paper's regime (``benchmarks/bench_packing.py`` at full scale): prompts of the JustRL
wrapper around DAPO-Math problems, responses of RL-trained Qwen3 base models."""
