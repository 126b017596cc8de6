"""benchmarks/sim_split.py: the streaming recipe's candidates (node split, recomputation, tau_H
source, engine share, reservation), their closed-form step and the simulated rows.

Deterministic: seeded lengths, simulated time; every figure is a function of the recipes and
the stored efficiencies."""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import sim_split  # noqa: E402

from stapo_megatron.recipes import paper, step_model  # noqa: E402


def test_the_candidates_are_whole_trainer_replicas_whose_dp_divides_a_mini_batch():
    cands = sim_split.candidates([4, 6], [0.85])
    splits = sorted({(c.nodes, c.trainer_gpus) for c in cands})
    # DP = trainer GPUs / 4 must divide 64 prompts: 12 and 20 trainer GPUs (DP 3, 5) are left out
    assert splits == [(4, 8), (4, 16), (6, 8), (6, 16), (6, 32)]
    assert len(cands) == len(splits) * 2 * 2  # recomputation x tau_H source
    c = sim_split.Candidate(6, 16, "none", "exact", 0.9, 3072)
    assert c.engine_gpus == 32 and "reserve 3072" in c.name and "DP=4" in c.name


def test_a_candidate_is_the_recipe_with_its_changes_and_the_memory_model_refuses_what_does_not_fit():
    sj, job, gb = sim_split.candidate_jobs(sim_split.Candidate(4, 8, "none", "old", 0.85))
    assert (sj.engine_gpus, sj.trainer_gpus, sj.trainer_replica_gpus, sj.forwards, sj.recompute) == (24, 8, 4, 1, False)
    assert (sj.memory_share, sj.reserve_tokens, job.num_gpus) == (0.85, 4096, 32)
    assert gb == pytest.approx(65.5, abs=0.05)  # every layer's activations of a 16k sequence at TP = 4
    # the package's recipe is this candidate
    cfg = paper.paper_recipe("qwen3_8b_stream")
    recipe = step_model.recipe_job(paper.ARCHITECTURES["qwen3_8b_stream"], paper.layout_for("qwen3_8b_stream", cfg),
                                   cfg)
    assert recipe == sj
    sj, _, gb = sim_split.candidate_jobs(sim_split.Candidate(6, 16, "full", "exact", 0.9))
    assert (sj.engine_gpus, sj.trainer_gpus, sj.forwards, sj.recompute, sj.memory_share) == (32, 16, 2, True, 0.9)
    assert gb == pytest.approx(27.2, abs=0.05)


def test_the_closed_form_ranks_per_gpu():
    rows = sim_split.closed_form([sim_split.Candidate(4, 8, "full", "exact", 0.85),
                                  sim_split.Candidate(4, 8, "none", "old", 0.85),
                                  sim_split.Candidate(5, 8, "none", "old", 0.85)], base_tps=1000.0)
    (_, r1, t1, _, x1), (_, r2, t2, _, x2), (_, r3, t3, _, x3) = rows
    assert (round(r1, 1), round(t1, 1)) == (150.1, 230.3) and (round(r2, 1), round(t2, 1)) == (150.1, 146.1)
    tokens = 2048 * (562 + 4221.8)  # a step's prompt and response tokens at the paper's lengths
    assert x1 == pytest.approx(tokens / 230.3 / 32 / 1000, rel=1e-3)
    assert x2 == pytest.approx(tokens / 150.1 / 32 / 1000, rel=1e-3)
    # one more engine node: the step is the trainers' again and it pays less per GPU
    assert t3 == pytest.approx(t2) and r3 < r2 and x3 == pytest.approx(tokens / t3 / 40 / 1000, rel=1e-3)
    assert x3 < x2


def test_the_sweep_prints_a_simulated_row_with_its_token_ages(capsys):
    sim_split.main(["--nodes", "4", "--shares", "0.85", "--etas", "3", "--schedules", "queue", "--orders",
                    "completion", "--steps", "8", "--warmup", "3", "--only", "4/8/none/old/0.85"])
    out = capsys.readouterr().out
    name = "| 4 nodes: 8 train (DP=2, recompute none, tau_H old)"
    rows = [line for line in out.splitlines() if line.startswith(name)]
    simulated = [r for r in rows if "| 3 | queue | completion |" in r]
    assert len(simulated) == 1
    cells = [c.strip() for c in simulated[0].split("|")[1:-1]]
    assert cells[5] == "150.1"  # the dry run's estimate
    assert float(cells[7].rstrip("x")) > 1.5
    ages = dict(part.split(": ") for part in cells[11].split(", "))
    assert sum(float(v.rstrip("%")) for v in ages.values()) == pytest.approx(100.0, abs=0.3)
