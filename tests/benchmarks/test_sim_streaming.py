"""benchmarks/sim_streaming.py (streaming rollouts) against timelines worked out by hand.

The toy job of one engine GPU and one trainer GPU: a decode iteration costs exactly 1 s (no KV,
per-sequence or prefill cost unless a case says so), the trainer trains a step in 1 s per token
(forward tokens / 4 s, update 3 x tokens / 4 s), the weights take 1 s to send, during which the
engine pauses; one prompt (group of one sample) a step unless a case says so. The comments give
each timeline.
"""

import os
import random
import sys

import pytest

from tests.helpers import REPO_DIR

sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

import sim_model as model  # noqa: E402
import sim_schedules as sched  # noqa: E402
import sim_streaming as stream  # noqa: E402

ONE_SECOND = model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0)
TOY = model.ModelSpec("toy", params=1.25e11, num_layers=0, attn_width=0, kv_heads=0)
EFF = model.Efficiency(forward_mfu=1.0, update_mfu=1.0, half_tokens=0.0, transfer_gb_per_s=250.0)
JOB = sched.Job(TOY, model.Hardware("toy", peak_tflops=1.0, hbm_tb_per_s=1.0, memory_gb=1e6), num_gpus=2,
                engine_tp=1, prompts_per_step=1, group=1, lengths=model.PAPER_LENGTHS, eff=EFF)


def _prompts(responses, prompt_len=1):
    return [model.Prompt(i, prompt_len, [r]) for i, r in enumerate(responses)]


def test_eta_zero_is_synchronous():
    # eta = 0 admits group j only under version j: prompt 0 decodes 0-2 and trains 2-5 (3 tokens);
    # the engine loads version 1 at 5-6, prompt 1 decodes 6-10 and trains 10-15 (5 tokens)
    r = stream.streaming(JOB, _prompts([2, 4, 2, 2]), steps=2, engine_gpus=1, eta=0, model=ONE_SECOND)
    assert r["step_ends"] == [5.0, 15.0]
    assert r["staleness"] == {0: 2}


def test_eta_one_admits_one_step_ahead():
    # prompts 0 and 1 start at 0 (j < (0 + 2) x 1); 0 ends at 2 and trains 2-5; the idle engine
    # loads version 1 at 5-6 and admits prompt 2 (6-8); prompt 1 (done at 4) trains 6-11 after the
    # trainer's send 5-6; load 11-12, prompt 3 12-14; prompt 2 trains 12-15
    r = stream.streaming(JOB, _prompts([2, 4, 2, 2, 2]), steps=3, engine_gpus=1, eta=1, model=ONE_SECOND)
    assert r["step_ends"] == [5.0, 11.0, 15.0]
    assert r["staleness"] == {0: 1, 1: 2}
    assert r["group_done"][2] == 8.0


@pytest.mark.parametrize("options, decode, ends, token_age", [
    # in flight: prompt 1 (6 tokens, started at 0) has 4 tokens at 4, when step 0 (prompt 0's 2
    # tokens, 2-4) ends; the engine pauses 4-5 for the load, prompt 1 ends at 7 (2 tokens of
    # version 1) and trains 7-13 (4 tokens 1 version old, 2 fresh); prompt 2, admitted at 5
    # under version 1, ends at 7 and trains 14-16 after the load 13-14
    (dict(), ONE_SECOND, [4.0, 13.0, 16.0], {0: 2 + 2, 1: 4 + 2}),
    # the same with the running context (4 tokens at 0.25 s) recomputed after the load: 5-6;
    # prompts 1 and 2 end at 8, train 8-14 and 15-17
    (dict(recompute_kv=True), model.DecodeModel(1.0, 0.0, 0.0, 0.25), [4.0, 14.0, 17.0], {0: 2 + 2, 1: 4 + 2}),
    # without in-flight updates the engine finishes prompt 1 under version 0 (4-6), then loads
    # (6-7) and admits prompt 2 (7-9); prompt 1 trains 6-12, prompt 2 13-15
    (dict(in_flight=False), ONE_SECOND, [4.0, 12.0, 15.0], {0: 2, 1: 6 + 2}),
])
def test_weight_loads_in_flight_recomputed_or_drained(options, decode, ends, token_age):
    r = stream.streaming(JOB, _prompts([2, 6, 2, 2, 2], prompt_len=0), steps=3, engine_gpus=1, eta=1, model=decode,
                         **options)
    assert r["step_ends"] == ends
    assert r["token_age"] == token_age
    assert r["staleness"] == {0: 1, 1: 2}


@pytest.mark.parametrize("order, ends", [
    # completion order: prompt 1 (2 tokens) ends first, at 2, and trains 2-5; prompt 0 (6 tokens)
    # pauses 5-6 for the load, ends at 7 and trains 7-14
    ("completion", [5.0, 14.0]),
    # admission order: step 0 waits for prompt 0 (done at 6) and trains it 6-13; the engine loads
    # 13-14 and admits prompt 2 (14-16); prompt 1 (done at 2) trains 14-17
    ("admission", [13.0, 17.0]),
])
def test_groups_train_in_completion_or_admission_order(order, ends):
    r = stream.streaming(JOB, _prompts([6, 2, 2, 2]), steps=2, engine_gpus=1, eta=1, order=order, model=ONE_SECOND)
    assert r["step_ends"] == ends


def test_a_full_kv_cache_preempts_the_newest_sequence():
    # room for 4 context tokens: both samples of prompt 0 (1 + 3 tokens each) start (2 tokens);
    # after one iteration (4 tokens) the next would need 6: the second is preempted and waits;
    # the first ends at 3, the second restarts (its 2 tokens prefilled again) and ends at 5
    decode = model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0,
                               kv_capacity_tokens=4)
    job = sched.Job(**{**JOB.__dict__, "group": 2})
    prompts = [model.Prompt(0, 1, [3, 3]), model.Prompt(1, 1, [1, 1]), model.Prompt(2, 1, [1, 1])]
    r = stream.streaming(job, prompts, steps=1, engine_gpus=1, eta=0, model=decode)
    assert r["group_done"] == {0: 5.0}
    assert (r["preemptions"], r["recomputed_tokens"]) == (1, 2)
    assert r["step_ends"] == [5.0 + 8.0]


def test_bad_settings_are_refused_naming_them():
    prompts = _prompts([2] * 4)
    with pytest.raises(ValueError, match="order"):
        stream.streaming(JOB, prompts, 1, 1, eta=1, order="random", model=ONE_SECOND)
    with pytest.raises(ValueError, match="eta"):
        stream.streaming(JOB, prompts, 1, 1, eta=-1, model=ONE_SECOND)
    with pytest.raises(ValueError, match="recompute_kv"):
        stream.streaming(JOB, prompts, 1, 1, eta=1, in_flight=False, recompute_kv=True, model=ONE_SECOND)
    with pytest.raises(ValueError, match="prompts"):
        stream.streaming(JOB, prompts, 3, 1, eta=1, model=ONE_SECOND)


@pytest.mark.parametrize("eta", [1, 2])
def test_admission_order_bounds_staleness_by_eta_and_completion_order_does_not(eta):
    # 2 engines, 2 prompts of 2 samples a step, lengths 1-3 with a long 20 now and then: in
    # admission order every group trains at most eta versions after it was admitted, and so does
    # every token (in-flight tokens are younger than their group); in completion order a slow
    # group waits while younger ones train, eta + 1 versions
    rng = random.Random(0)
    prompts = [model.Prompt(i, 1, [rng.choice([1, 2, 3, 20]) for _ in range(2)]) for i in range(40)]
    job = sched.Job(**{**JOB.__dict__, "num_gpus": 3, "prompts_per_step": 2, "group": 2})
    admission = stream.streaming(job, prompts, 10, 2, eta, order="admission", model=ONE_SECOND)
    completion = stream.streaming(job, prompts, 10, 2, eta, order="completion", model=ONE_SECOND)
    assert max(admission["staleness"]) == max(admission["token_age"]) == eta
    assert max(completion["staleness"]) == eta + 1
    assert sum(completion["staleness"].values()) == sum(admission["staleness"].values()) == 10 * 2
    # admission order trains the first 20 groups, every token of them
    assert sum(admission["token_age"].values()) == sum(r for p in prompts[:20] for r in p.responses)


@pytest.mark.parametrize("schedule, ends, done", [
    # one replica (one trainer GPU), two engines that run one sequence at a time (3 KV tokens),
    # 2 prompts a step, eta = 1. slices: engine 0's stream is prompts 0, 2, 4 (a step's quota 1),
    # engine 1's 1, 3, 5; engine 0 decodes prompt 0 (0-4), engine 1 prompts 1 (0-1) and 3 (1-2)
    # and stops at its bound (its third group would train at step 2); step 0 waits for engine 0's
    # slice and trains prompts 0 and 1 (5 + 2 tokens) 4-11
    ("slices", [11.0], {0: 4.0, 1: 1.0, 3: 2.0}),
    # queue: one stream, quota 2, either engine admits its next group: engine 1 decodes prompts
    # 1, 2 and 3 (0-3) while engine 0 decodes prompt 0; step 0 trains the first two complete,
    # prompts 1 and 2 (2 + 2 tokens) 2-6
    ("queue", [6.0], {0: 4.0, 1: 1.0, 2: 2.0, 3: 3.0}),
])
def test_slices_wait_for_their_slowest_engine_and_the_queue_does_not(schedule, ends, done):
    decode = model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=0.0,
                               kv_capacity_tokens=3)
    job = sched.Job(**{**JOB.__dict__, "num_gpus": 3, "prompts_per_step": 2})
    r = stream.streaming(job, _prompts([4, 1, 1, 1, 1, 1]), steps=1, engine_gpus=2, eta=1, model=decode,
                         schedule=schedule)
    assert r["step_ends"] == ends
    assert {g: t for g, t in r["group_done"].items() if t <= 4.0} == done


def test_the_slices_are_the_built_plan_chunks():
    # the recipe's split: 2 trainer replicas of 128 prompts a step over 24 engines: 12 slices each,
    # engine (i x 12 + j) mod 24, the prompts remote.plan_chunks gives each engine
    from stapo_megatron.rollout.remote import plan_chunks

    streams = stream.plan_streams("slices", 3 * 256, 256, 24, 2)
    chunks = plan_chunks([128, 128], 24)
    assert len(streams) == len(chunks) == 24
    for s, c in zip(streams, chunks):
        assert s.engines == [c.engine] and s.quota == c.end - c.start
        assert s.prompts[:s.quota] == [c.dest * 128 + k for k in range(c.start, c.end)]  # step 0, replica dest
        assert s.prompts[s.quota:2 * s.quota] == [256 + c.dest * 128 + k for k in range(c.start, c.end)]
    queue = stream.plan_streams("queue", 3 * 256, 256, 24, 2)
    assert [(q.engines, q.quota) for q in queue] == [(list(range(12)), 128), (list(range(12, 24)), 128)]
    assert [len(s.prompts) for s in stream.plan_streams("shared", 3 * 256, 256, 24, 2)] == [768]
    with pytest.raises(ValueError, match="schedule"):
        stream.plan_streams("random", 10, 2, 2, 1)
    with pytest.raises(ValueError, match="prompts_per_step"):
        stream.plan_streams("queue", 10, 3, 2, 2)
