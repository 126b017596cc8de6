"""`stapo_megatron.serve.merged_calls` with the real HF engine on a tiny model: several askers'
calls as one engine call with each asker's samples, and two partial-rollout pools stepped in
lockstep, one engine call a round for both, returning what each pool returns stepped alone."""

import json

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.data.tokenizer import build_char_tokenizer
from stapo_megatron.rollout.base import prompt_seeds
from stapo_megatron.rollout.config import RolloutConfig, SamplingSettings
from stapo_megatron.rollout.hf_engine import HFEngine
from stapo_megatron.serve.merged_calls import Call, generate_merged, step_together
from stapo_megatron.serve.partial import PartialPool

EOS, G, MAX_TOKENS, ROUND = 3, 2, 12, 4
PROMPTS = [[5, 17, 20, 3], [42] * 6, [1, 2, 3, 4, 5], [7, 7, 9], [11, 12], [30, 31, 32, 33], [8, 6, 4], [2, 9]]


class CountingEngine:
    """The HF engine, counting its ``generate`` calls (the rows each asked for)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, *args, **kwargs):
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, *args, **kwargs)

    def detokenize(self, token_ids):
        return self.engine.detokenize(token_ids)


@pytest.fixture(scope="module")
def make_engine(tmp_path_factory):
    """Engines on one tiny folder whose end token's output row is tripled (responses end at varied
    lengths, so pools finish their groups in different rounds)."""
    root = tmp_path_factory.mktemp("merged")
    folder = str(root / "tiny")
    save_tiny_hf_model(folder, "qwen3", dtype=torch.float32, seed=0)
    build_char_tokenizer(folder)
    config = json.loads((root / "tiny" / "config.json").read_text())
    (root / "tiny" / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    weights = HFEngine(folder, RolloutConfig(dtype="float32")).model.state_dict()
    weights["lm_head.weight"][EOS] *= 3

    def make():
        engine = HFEngine(folder, RolloutConfig(dtype="float32"))
        engine.update_weights(iter(weights.items()))
        return CountingEngine(engine)

    return make


def _tokens(samples):
    return [[s.token_ids for s in group] for group in samples]


def test_prompt_seeds_per_prompt_and_refused_lengths():
    assert prompt_seeds(10, 3, 4) == [10, 14, 18] and prompt_seeds(None, 3, 4) is None
    assert prompt_seeds([7, 100], 2, 4) == [7, 100]
    with pytest.raises(ValueError, match="seed holds 1 per-prompt seeds for 2 prompts"):
        prompt_seeds([7], 2, 4)


def test_calls_of_equal_settings_are_one_engine_call_with_each_calls_samples(make_engine):
    engine = make_engine()
    calls = [Call(PROMPTS[:3], SamplingSettings(G, 1.0, 1.0, 6, 100)), Call([], SamplingSettings(G, 1.0, 1.0, 6, 7)),
             Call(PROMPTS[3:5], SamplingSettings(G, 1.0, 1.0, 6, 900)),
             Call(PROMPTS[5:6], SamplingSettings(1, 1.0, 1.0, 6, 5))]
    out = generate_merged(engine, calls)
    assert engine.calls == [5, 1]  # the two G-sample calls as one; n = 1 on its own; none for no prompts
    assert out[1] == ([], 0.0)
    alone = make_engine()
    for call, (samples, seconds) in zip(calls, out):
        expected = call.settings.generate(alone, call.prompts) if call.prompts else []
        assert _tokens(samples) == _tokens(expected)  # the same seeds: the same tokens
        assert seconds >= 0
    # the merged call's seconds are shared by tokens: the shares add up to it, none is zero
    assert all(seconds > 0 for samples, seconds in out if samples)


def _step(pool, step, first, engine):
    """One pool's step over its own data order (positions from ``first``)."""
    window = [(p, first + p, PROMPTS[(first + p) % len(PROMPTS)]) for p in range(3 * step, 3 * step + 4)]
    groups = pool.step(engine, window, SamplingSettings(G, 1.0, 1.0, MAX_TOKENS, 1000 * first + 100 * step),
                       want=3, capacity=4, round_tokens=ROUND, version=step)
    return [(g.index, _tokens([g.samples])[0]) for g in groups]


def test_two_pools_in_lockstep_return_what_each_returns_alone_in_fewer_engine_calls(make_engine):
    alone, calls_alone = [], 0
    for first in (0, 4):  # each replica's pool on an engine of its own
        engine, pool = make_engine(), PartialPool()
        alone.append([_step(pool, step, first, engine) for step in range(3)])
        calls_alone += len(engine.calls)
    engine, pools, together = make_engine(), [PartialPool(), PartialPool()], [[], []]
    for step in range(3):
        finished = []
        step_together(engine, [lambda e, i=i: _step(pools[i], step, 4 * i, e) for i in range(2)],
                      lambda i, result, seconds: (together[i].append(result), finished.append(i)))
        assert sorted(finished) == [0, 1]
    # the same seeds: the same groups, tokens and order (this tiny fp32 model's padded batches
    # round alike; a larger model may differ by float rounding)
    assert together == alone
    assert len(engine.calls) < calls_alone  # rounds of both pools shared engine calls


def test_a_failing_step_raises_after_the_others_finish(make_engine):
    engine, done = make_engine(), []

    def failing(e):
        e.generate(PROMPTS[:1], 1, 1.0, 1.0, 2, seed=1)
        raise RuntimeError("pool failed")

    with pytest.raises(RuntimeError, match="pool failed"):
        step_together(engine, [failing, lambda e: e.generate(PROMPTS[1:2], 1, 1.0, 1.0, 2, seed=2)],
                      lambda i, result, seconds: done.append(i))
    assert done == [1]
