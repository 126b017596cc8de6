"""benchmarks/sleeping_vllm.py: the real `StreamingGenerator` driven over the sleeping stand-in
for vLLM's request API. Counts and structure only (never timing): every group's responses are
the lengths the stand-in draws for its prompt, every token carries the version that sampled it,
groups complete at the iteration of their longest sample, admission is refused by eta and by
capacity, and each weight-load mode loads between two iterations as it says.

The toy engine: prompts of a few tokens with hand-picked response lengths, a time scale so large
that every sleep is a few microseconds.
"""

import dataclasses
import os
import sys

import pytest
import torch

from tests.helpers import REPO_DIR

pytest.importorskip("vllm")
sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))

from sim_model import DecodeModel, Prompt  # noqa: E402
from sleeping_vllm import BLOCK_SIZE, SleepingVLLM  # noqa: E402

from stapo_megatron.serve.streaming import StreamingGenerator  # noqa: E402

DECODE = DecodeModel(weight_s=0.01, kv_s_per_token=1e-6, seq_s=1e-4, prefill_s_per_token=1e-5,
                     kv_capacity_tokens=64 * BLOCK_SIZE, max_num_seqs=8)
PROMPTS = [Prompt(0, 5, [3, 7]), Prompt(1, 4, [2, 2]), Prompt(2, 6, [9, 1]), Prompt(3, 3, [4, 5])]
MAX_TOKENS = 8  # prompt 2's first sample (9 tokens) is cut at 8
WEIGHTS = [("w", torch.zeros(4)), ("b", torch.zeros(2))]


def prompt_ids(p: Prompt) -> list:
    return [p.index] + [0] * (p.prompt_len - 1)


def generator(engine, **kw):
    """A `StreamingGenerator` over ``engine``: G = 2, T = 1.0, max_tokens = MAX_TOKENS, max_staleness = 1 unless ``kw`` says
    otherwise (``group_size``, ``temperature``, ``top_p``, ``max_tokens``: its `SamplingSettings`)."""
    from stapo_megatron.rollout.config import SamplingSettings
    from stapo_megatron.serve.streaming import StreamingGenerator

    settings = SamplingSettings(n=kw.pop("group_size", 2), temperature=kw.pop("temperature", 1.0),
                                top_p=kw.pop("top_p", 1.0), max_tokens=kw.pop("max_tokens", MAX_TOKENS))
    return StreamingGenerator(engine, settings, **{"max_staleness": 1, **kw})


def engine(**kw) -> SleepingVLLM:
    return SleepingVLLM(DECODE, PROMPTS, scale=1e6, **kw)


def run_to_end(gen: StreamingGenerator) -> int:
    steps = 0
    while gen.num_running_samples:
        gen.step()
        steps += 1
    return steps


def test_groups_have_the_drawn_lengths_and_complete_in_order():
    eng = engine()
    gen = generator(eng)
    for p in PROMPTS[:3]:
        assert gen.admit(prompt_ids(p), seed=10 * p.index, trained_version=0, key=p.index)
    assert gen.num_running_samples == 6
    assert eng.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 64 + 1  # and vLLM's null block
    assert run_to_end(gen) == 8  # the longest sample: 9 tokens cut at max_tokens
    groups = gen.take()
    # completion order: prompt 1 (longest 2) at iteration 2, prompt 0 (7) at 7, prompt 2 (8) at 8
    assert [(g.key, g.completed_step) for g in groups] == [(1, 2), (0, 7), (2, 8)]
    for g in groups:
        drawn = PROMPTS[g.key].responses
        assert [len(s.token_ids) for s in g.samples] == [min(r, MAX_TOKENS) for r in drawn]
        assert [s.finish_reason for s in g.samples] == ["stop" if r <= MAX_TOKENS else "length" for r in drawn]
        assert all(s.versions == [0] * len(s.token_ids) for s in g.samples)
        assert all(s.logprobs == [0.0] * len(s.token_ids) for s in g.samples)
        assert [s.token_ids[0] for s in g.samples] == [min(r, MAX_TOKENS) for r in drawn]  # its length
        assert g.prompt_token_ids == prompt_ids(PROMPTS[g.key]) and g.admission_version == 0
    llm = eng.llm.llm_engine
    assert (llm.iterations, llm.steps, llm.running) == (8, 8, {})
    assert eng.busy_s > 0 and gen.take() == []


def test_admission_order_waits_for_earlier_groups():
    gen = generator(engine(), order="admission")
    for p in PROMPTS[:3]:
        gen.admit(prompt_ids(p), seed=0, trained_version=0, key=p.index)
    taken = []
    while gen.num_running_samples:
        gen.step()
        taken.append([g.key for g in gen.take()])
    # prompt 1 completes at iteration 2 but waits for prompt 0 (iteration 7)
    assert taken == [[], [], [], [], [], [], [0, 1], [2]]


def test_eta_and_capacity_refuse_admission():
    gen = generator(engine(), max_staleness=1)
    assert gen.admit(prompt_ids(PROMPTS[0]), 0, trained_version=1)  # version 0 >= 1 - 1
    assert gen.refusal(5, trained_version=2).startswith("eta")
    assert not gen.admit(prompt_ids(PROMPTS[1]), 0, trained_version=2) and gen.num_running_samples == 2
    gen.load_weights(iter(WEIGHTS), version=1)
    assert gen.admit(prompt_ids(PROMPTS[1]), 0, trained_version=2)
    # max_num_seqs 8: two more groups of 2 fit, a fourth does not
    assert gen.admit(prompt_ids(PROMPTS[2]), 0, trained_version=2)
    assert gen.admit(prompt_ids(PROMPTS[3]), 0, trained_version=2)
    assert "max_running_samples" in gen.refusal(5, trained_version=2) and gen.num_running_samples == 8
    kv = generator(engine(), max_kv_tokens=3 * 2 * BLOCK_SIZE)  # a group of prompt + max_tokens <= 16 each: 2 blocks
    assert kv.admit(prompt_ids(PROMPTS[0]), 0, 0) and kv.admit(prompt_ids(PROMPTS[1]), 0, 0)
    assert kv.admit(prompt_ids(PROMPTS[2]), 0, 0) and "max_kv_tokens" in kv.refusal(3, 0)
    assert kv.reserved_kv_tokens == 3 * 2 * BLOCK_SIZE


@pytest.mark.parametrize("mode", ["in_flight", "recompute", "drain"])
def test_weights_between_iterations(mode):
    eng = engine()
    gen = generator(eng)
    gen.admit(prompt_ids(PROMPTS[0]), 0, 0, key=0)  # responses of 3 and 7 tokens
    for _ in range(2):
        gen.step()
    drained = gen.load_weights(iter(WEIGHTS), version=1, mode=mode)
    llm = eng.llm.llm_engine
    assert llm.loads == 1 and gen.version == 1
    gen.admit(prompt_ids(PROMPTS[1]), 0, 1, key=1)  # responses of 2 and 2 tokens, all under version 1
    run_to_end(gen)
    groups = {g.key: g for g in gen.take()}
    if mode == "drain":  # the running group finished under version 0 first
        assert drained == 5 and groups[0].completed_step == 7 and llm.recomputed_tokens == 0
        assert [s.versions for s in groups[0].samples] == [[0] * 3, [0] * 7]
    else:  # two tokens each under version 0, the rest under version 1
        assert drained == 0
        assert [s.versions for s in groups[0].samples] == [[0, 0, 1], [0, 0] + [1] * 5]
        # recompute: both samples prefill their prompt (5) and 2 tokens again after the load
        assert llm.recomputed_tokens == (2 * (5 + 2) if mode == "recompute" else 0)
    assert groups[1].admission_version == 1 and all(s.versions == [1, 1] for s in groups[1].samples)
    assert [len(s.token_ids) for key in (0, 1) for s in groups[key].samples] == [3, 7, 2, 2]


def test_iterations_per_step_end_at_each_finish():
    eng = engine(iterations_per_step=4)
    gen = generator(eng)
    for p in PROMPTS[:3]:
        gen.admit(prompt_ids(p), 0, 0, key=p.index)
    steps = run_to_end(gen)
    llm = eng.llm.llm_engine
    # steps end at iterations 1 (prompt 2's second sample), 2 (prompt 1), 3 (prompt 0's first), 7 (its
    # second) and 8 (prompt 2's first)
    assert (steps, llm.iterations) == (5, 8)
    lengths = {g.key: [len(s.token_ids) for s in g.samples] for g in gen.take()}
    assert lengths == {0: [3, 7], 1: [2, 2], 2: [8, 1]}


def test_abort_drops_running_requests_and_bad_input_is_refused():
    eng = engine()
    gen = generator(eng)
    gen.admit(prompt_ids(PROMPTS[0]), 0, 0)
    gen.step()
    assert gen.abort() == 2 and eng.llm.llm_engine.running == {} and gen.step() == 0
    with pytest.raises(ValueError, match="scale"):
        SleepingVLLM(DECODE, PROMPTS, scale=0)
    with pytest.raises(ValueError, match="iterations_per_step"):
        engine(iterations_per_step=0)


def test_a_reserve_below_max_tokens_preempts_the_newest_request_and_recomputes_its_context():
    """A cache of 8 blocks (128 tokens) and groups of 2 samples of prompt 10 + 30 tokens: at the
    worst case (prompt + max_tokens 40 = 3 blocks a sample) one group runs at a time and nothing
    is preempted; reserving 6 tokens (1 block a sample) admits all four groups, whose 320 tokens
    of context outgrow the cache: the newest running requests are preempted, wait, and prefill
    their prompt and tokens so far again, and every group still completes at its drawn lengths."""
    decode = dataclasses.replace(DECODE, kv_capacity_tokens=8 * BLOCK_SIZE)
    prompts = [Prompt(i, 10, [30, 30]) for i in range(4)]

    def run(reserve_tokens):
        eng = SleepingVLLM(decode, prompts, scale=1e6)
        gen = generator(eng, max_tokens=40, reserve_tokens=reserve_tokens)
        llm, waiting, most = eng.llm.llm_engine, list(prompts), 0
        while waiting or gen.num_running_samples:
            while waiting and gen.admit(prompt_ids(waiting[0]), 0, 0, key=waiting[0].index):
                waiting.pop(0)
            most = max(most, len(llm.running) + len(llm.waiting))
            gen.step()
            assert sum(r.context for r in llm.running.values()) <= decode.kv_capacity_tokens
        return {g.key: g for g in gen.take()}, llm, most

    worst, worst_llm, worst_most = run(None)
    groups, llm, most = run(6)
    assert (worst_llm.preemptions, worst_llm.recomputed_tokens, worst_most) == (0, 0, 2)
    assert most == 8 and llm.preemptions > 0
    assert llm.recomputed_tokens > 10 * llm.preemptions  # each restart: the prompt and at least a token
    for found in (worst, groups):
        assert sorted(found) == [0, 1, 2, 3]
        assert all(len(s.token_ids) == 30 and s.versions == [0] * 30 for g in found.values() for s in g.samples)
    assert llm.iterations < worst_llm.iterations  # more samples ran at once
