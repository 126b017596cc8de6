"""benchmarks/sim_schedules.py and sim_model.py (the rollout-schedule model) against cases worked out by hand.

Every timeline case uses a decode model where one iteration costs exactly 1 s (no KV, per-sequence
or prefill cost), a toy model whose pi_old forward costs tokens / (4 x GPUs) s and update
3 x tokens / (4 x GPUs) s (no attention, no MFU fall-off), a colocated switch of 1 s and a weight
transfer of 1 s, so each schedule's timeline can be written down (the comments give it).
"""

import os
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import sim_model as model  # noqa: E402
import sim_schedules as sched  # noqa: E402

ONE_SECOND = model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0)
TOY = model.ModelSpec("toy", params=1.25e11, num_layers=0, attn_width=0, kv_heads=0)
# 2 x params x tokens / (1e12 x gpus) = tokens / (4 x gpus): forward; 6 x ... = 3 x tokens / (4 x gpus): update;
# weights 250 GB: sleep/wake 0.5 s + 250 / 500 s reload = 1 s colocated, 250 / 250 s transfer = 1 s separate
EFF = model.Efficiency(forward_mfu=1.0, update_mfu=1.0, half_tokens=0.0, sleep_wake_s=0.5, refit_gb_per_s=500.0,
                       transfer_gb_per_s=250.0)
JOB = sched.Job(TOY, model.Hardware("toy", peak_tflops=1.0, hbm_tb_per_s=1.0, memory_gb=1e6), num_gpus=2, engine_tp=1,
                prompts_per_step=2, group=1, lengths=model.PAPER_LENGTHS, eff=EFF)


def _batch(first_index):
    """Two prompts of 1 token with one response each, of 2 and 4 tokens: 3 + 5 = 8 tokens."""
    return [model.Prompt(first_index, 1, [2]), model.Prompt(first_index + 1, 1, [4])]


def test_the_closed_form_of_m_iterations_sums_the_iterations():
    decode = model.DecodeModel(weight_s=0.5, kv_s_per_token=0.01, seq_s=0.1, prefill_s_per_token=0.0)
    contexts, m = [10, 30, 7], 5
    by_hand = sum(0.5 + 0.1 * len(contexts) + 0.01 * sum(c + j for c in contexts) for j in range(m))
    assert decode.time(sum(contexts), len(contexts), m) == pytest.approx(by_hand, rel=1e-12)
    assert decode.iterations_within(sum(contexts), len(contexts), by_hand, 100) == m


def test_the_mfu_falls_as_the_tokens_per_gpu_shrink():
    # mfu(w) = mfu_max x w / (w + half_tokens): at w = half_tokens the phase takes twice its FLOPs' time
    eff = model.Efficiency(forward_mfu=1.0, half_tokens=4.0)
    hw = JOB.hardware
    assert model.train_phase_s(TOY, hw, eff, [4, 4], 2, "forward") == pytest.approx(2 * 8 / 4 / 2)
    assert model.train_phase_s(TOY, hw, eff, [4, 4], 1, "forward") == pytest.approx(1.5 * 8 / 4 / 1)
    assert model.train_phase_s(TOY, hw, EFF, [4, 4], 1, "update", recompute=True) == pytest.approx(8 * 8 / 8)


def test_the_capped_mean_of_the_length_distribution():
    lengths = model.Lengths((1, 1), response_median=100.0, response_sigma=0.5, response_cap=10**9)
    assert lengths.mean_response() == pytest.approx(100.0 * 2.718281828 ** (0.5 ** 2 / 2), rel=1e-9)
    capped = model.PAPER_LENGTHS.with_mean_response(3000.0)
    assert capped.mean_response() == pytest.approx(3000.0, rel=1e-6)
    drawn = model.sample_prompts(capped, 4000, 1, seed=0)
    assert sum(p.responses[0] for p in drawn) / 4000 == pytest.approx(3000.0, rel=0.03)  # sampling error of 4000


def test_colocated_timeline_and_phases():
    # per step: engines of 2 and 4 iterations -> 4 s, switch 1 s, forward 8 / 8 = 1 s, update 3 s
    r = sched.colocated(JOB, [_batch(0), _batch(2)], model=ONE_SECOND)
    assert r["step_ends"] == [9.0, 18.0]
    assert r["phases"] == {"generate": 4.0, "switch": 1.0, "forward": 1.0, "update": 3.0}
    assert r["engine_idle"] == pytest.approx(1 - (2 + 4 + 2 + 4) / (2 * 18))
    s = sched.steady(r, JOB.num_gpus, warmup=1)
    assert (s["step_s"], s["fill_s"]) == (9.0, 0.0)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(8 / 9 / 2)


def test_colocated_generation_pays_its_preemptions():
    # one engine of 6 context tokens, prefill 0.5 s a token: the engine's timeline of
    # test_sim_engine.test_a_full_cache_preempts_the_newest_sequence_which_recomputes_its_context
    # (done at 6.5 instead of 4.0 with room), then switch 1 s, forward 8 / 4 = 2 s, update 6 s
    decode = model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.5,
                               kv_capacity_tokens=6)
    job = sched.Job(**{**JOB.__dict__, "num_gpus": 1, "prompts_per_step": 1, "group": 2})
    r = sched.colocated(job, [[model.Prompt(0, 1, [3, 3])]], model=decode)
    assert r["phases"] == {"generate": 6.5, "switch": 1.0, "forward": 2.0, "update": 6.0}
    assert r["step_ends"] == [15.5]
    assert (r["preemptions"], r["recomputed_tokens"], r["kv_peak"]) == (1, 3, 1.0)


@pytest.mark.parametrize("k, ends", [
    # k = 0: generate 0-4, train 4-12, send weights 12-13; generate 13-17, train 17-25
    (0, [12.0, 25.0]),
    # k = 1: the second batch (version 0) is generated 2-4 and 4-8 while the first trains 4-12;
    # the trainer sends the weights 12-13 and trains 13-21
    (1, [12.0, 21.0]),
])
def test_separate_timeline(k, ends):
    r = sched.separate(JOB, [_batch(0), _batch(2)], engine_gpus=1, k=k, model=ONE_SECOND)
    assert r["step_ends"] == ends
    assert r["trainer_busy_s"] == 16.0


def test_partial_rollout_timeline_and_staleness():
    # one sequence in flight, one prompt per step. Prompt 0 (2 tokens) is done at 2 and trains 2-5
    # (3 tokens); prompt 1, admitted at 2 under version 0, decodes 2-5, pauses 5-6 for the new
    # weights, ends at 7; the trainer sends the weights 5-6 and trains prompt 1 7-12 (5 tokens) as
    # a sample one version stale
    prompts = [model.Prompt(0, 1, [2]), model.Prompt(1, 1, [4]), model.Prompt(2, 1, [2]), model.Prompt(3, 1, [2])]
    job = sched.Job(**{**JOB.__dict__, "prompts_per_step": 1})
    r = sched.partial(job, prompts, steps=2, engine_gpus=1, oversample=0.0, model=ONE_SECOND)
    assert r["step_ends"] == [5.0, 12.0]
    assert r["staleness"] == {0: 1, 1: 1}


@pytest.mark.parametrize("per_sequence, done", [
    # two sequences in flight: prompt 0's 2-token sample ends at 2 and admits prompt 1's first
    # sample (2-4), which admits its second (4-6): prompt 1's group is done at 6
    (True, 6.0),
    # a group admits the next group only when it ends: prompt 1 starts when prompt 0 ends at 6
    (False, 8.0),
])
def test_partial_admits_per_sequence(per_sequence, done):
    prompts = [model.Prompt(0, 1, [2, 6])] + [model.Prompt(i, 1, [2, 2]) for i in range(1, 4)]
    job = sched.Job(**{**JOB.__dict__, "prompts_per_step": 1, "group": 2})
    r = sched.partial(job, prompts, steps=2, engine_gpus=1, oversample=0.0, per_sequence=per_sequence,
                      model=ONE_SECOND)
    assert r["group_done"][0] == 6.0
    assert r["group_done"][1] == done


def test_splits_follow_the_node_layout():
    # 32 GPUs, trainer replicas of 8, 2048 samples: 24 trainer GPUs (DP 3) do not divide the step;
    # a TP=3 engine would straddle nodes of 8
    job = sched.Job(model.QWEN3_8B, model.H100, num_gpus=32, engine_tp=4, prompts_per_step=256, group=8,
                    lengths=model.PAPER_LENGTHS, trainer_replica_gpus=8)
    assert sched.splits(job, (1, 3, 4)) == [(1, 16), (1, 24), (4, 16), (4, 24)]
    # replicas of 1 GPU: trainer DP 28, 24, 20 and 12 do not divide 2048 samples; 16, 8 and 4 do
    job = sched.Job(**{**job.__dict__, "trainer_replica_gpus": 1})
    assert [g for tp, g in sched.splits(job, (4,))] == [16, 24, 28]


def test_steady_state_leaves_the_fill_out():
    run = {"step_ends": [10.0, 15.0, 20.0, 25.0], "step_tokens": [100, 100, 100, 100], "trainer_busy_s": 10.0,
           "engine_idle": 0.0}
    s = sched.steady(run, num_gpus=2, warmup=2)
    assert (s["step_s"], s["fill_s"]) == (5.0, 5.0)
    assert s["tokens_per_s_per_gpu"] == 200 / 10 / 2
    assert s["with_fill"] == 400 / 25 / 2
    with pytest.raises(ValueError, match="warmup=4"):
        sched.steady(run, num_gpus=2, warmup=4)


def test_a_mixture_of_experts_reads_the_experts_its_batch_is_routed_to():
    # 2 GB of dense weights and 8 GB of experts at 1 TB/s (HBM at 100%, no overheads): an
    # iteration over n sequences reads 2 GB + 8 GB x (1 - (1 - 1/4)^n); FLOPs count the active
    # 1.5e9 parameters (2 x 1.5e9 / 1e12 s a sequence)
    moe = model.ModelSpec("moe", params=5e9, num_layers=1, attn_width=128, kv_heads=1, active_params=1.5e9,
                          expert_params=4e9, expert_share=0.25)
    eff = model.Efficiency(iteration_overhead_s=0.0, hbm_efficiency=1.0, decode_mfu=1.0)
    hw = model.Hardware("toy", peak_tflops=1.0, hbm_tb_per_s=1.0, memory_gb=100.0)
    decode = model.decode_model(moe, hw, eff, tp=1, memory_share=0.5)
    for n in (1, 2, 16):
        assert decode.time(0, n, 1) == pytest.approx(2e-3 + 8e-3 * (1 - 0.75 ** n) + n * 3e-3, rel=1e-12)
    assert moe.flop_params == 1.5e9 and model.QWEN3_8B.flop_params == model.QWEN3_8B.params
    assert model.switch_s(moe, eff, colocated=False) == pytest.approx(10 / eff.transfer_gb_per_s)  # all weights


def test_splits_keep_to_the_trainer_gpu_counts_the_memory_allows():
    # the 30B-A3B's trainers: 16 or 24 GPUs (8 do not hold its optimizer state); DP 24 / 4 = 6
    # does not divide 2048 samples, so only 16 engine GPUs remain
    job = sched.Job(model.QWEN3_30B_A3B, model.H100, num_gpus=32, engine_tp=4, prompts_per_step=256, group=8,
                    lengths=model.PAPER_LENGTHS, trainer_replica_gpus=4, trainer_gpu_counts=(16, 24))
    assert sched.splits(job, (2, 4)) == [(2, 16), (4, 16)]
