"""The rollout-schedule model (benchmarks/sim_calibrate.py) against the two published runs it is
calibrated on: NeMo-RL's Llama-3.1-8B GRPO on 16 H100s (colocated and one step off) and verl
fully-async's Qwen2.5-Math-7B colocated phase tables on 32, 64 and 128 H20s.

The target is every figure within 10%. The fitted model meets it for all but the figures in
`MISSES`, each of which is asserted at its present error: one set of efficiencies cannot match
both NeMo-RL's H100 decode rate and verl's 32-GPU generation-to-training balance (the fit trades
them; RESULTS.md gives the residuals). The simulation is deterministic (seeded lengths,
simulated time), so the figures are exact functions of the stored parameters.
"""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import sim_calibrate as cal  # noqa: E402

CALIBRATED = 0.10
"""The calibration target: a figure within 10% of the published one."""
MISSES = {
    ("NeMo-RL Llama-3.1-8B", "one-step-off tokens/s/GPU"): 0.12,
    ("NeMo-RL Llama-3.1-8B", "one-step-off step s"): 0.13,
    ("verl Qwen2.5-Math-7B, 32 H20", "generate s"): 0.15,
    ("verl Qwen2.5-Math-7B, 32 H20", "forward s"): 0.15,
}
"""Figures outside the target, with the bound of their present error (-11%, +13%, -14%, +14%)."""


@pytest.fixture(scope="module")
def rows():
    return {(case, figure): (measured, simulated, kind)
            for case, figure, measured, simulated, _, kind in cal.residuals()}


def test_nemo_rl_colocated_and_ratio_within_the_target(rows):
    for figure in ("colocated tokens/s/GPU", "colocated step s", "ratio"):
        measured, simulated, _ = rows[("NeMo-RL Llama-3.1-8B", figure)]
        assert simulated == pytest.approx(measured, rel=CALIBRATED), figure


def test_verl_held_out_training_phases_within_the_target(rows):
    held_out = [key for key, (_, _, kind) in rows.items() if kind == "held out"]
    assert len(held_out) == 4
    for key in held_out:
        measured, simulated, _ = rows[key]
        assert simulated == pytest.approx(measured, rel=CALIBRATED), key


def test_every_figure_is_within_the_target_but_the_stated_misses(rows):
    outside = {key for key, (m, s, _) in rows.items() if abs(s / m - 1) > CALIBRATED}
    assert outside == set(MISSES)
    for key, bound in MISSES.items():
        measured, simulated, _ = rows[key]
        assert simulated == pytest.approx(measured, rel=bound), key


def test_the_case_lengths_have_the_published_means():
    job = cal.nemo_job(cal.Efficiency(), cal.NEMO["colocated_mean_response"], cal.CASE_SIGMA)
    assert job.lengths.mean_response() == pytest.approx(1019.0, rel=1e-6)
    job = cal.verl_job(cal.Efficiency(), 32, cal.VERL_MEAN_RESPONSE[32], cal.CASE_SIGMA)
    assert job.lengths.mean_response() == pytest.approx(cal.VERL_MEAN_RESPONSE[32], rel=1e-6)
