"""Partial rollouts on an engine (`stapo_megatron.trainer.partial.PartialPool`) with the real HF
engine on a tiny model: rounds counted in tokens, the first finished groups in admission order,
the rest continued by the next step under newer weights (each token keeping its version), windows
of the data order taken once, and the same inputs giving the same steps."""

import json

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.data.tokenizer import build_char_tokenizer
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.hf_engine import HFEngine
from stapo_megatron.trainer.partial import PartialPool, stale_mask

MAX_TOKENS, ROUND, G = 12, 4, 2
PROMPTS = [[5, 17, 20, 3], [42] * 6, [1, 2, 3, 4, 5], [7, 7, 9], [11, 12], [30, 31, 32, 33]]


EOS = 3
"""The tiny folders' end token: its output row is tripled so that responses end at varied lengths
(with none, every response would run to the limit and every group finish in the same round)."""


def _weights(folder):
    state = HFEngine(folder, RolloutConfig(dtype="float32")).model.state_dict()
    state["lm_head.weight"][EOS] *= 3
    return state


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A maker of engines holding version 0, and version 1's weights."""
    root = tmp_path_factory.mktemp("partial")
    for name, seed in (("v0", 0), ("v1", 1)):
        folder = str(root / name)
        save_tiny_hf_model(folder, "qwen3", dtype=torch.float32, seed=seed)
        build_char_tokenizer(folder)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    v0, v1 = _weights(str(root / "v0")), _weights(str(root / "v1"))

    def make():
        engine = HFEngine(str(root / "v0"), RolloutConfig(dtype="float32"))
        engine.update_weights(iter(v0.items()))
        return engine

    return make, v1


def _window(step, per_step=3, extra=1):
    """Positions and indices of a replica's data order: step s's prompts and the next one's first."""
    pairs = [(p, p, PROMPTS[p % len(PROMPTS)]) for p in range(step * per_step, (step + 1) * per_step + extra)]
    return pairs


def _run(engine, v1, steps=3):
    pool, out = PartialPool(), []
    for step in range(steps):
        if step == 1:
            engine.update_weights(iter(v1.items()))  # the engine's weights change between steps
        groups = pool.step(engine, _window(step), want=3, capacity=4, n=G, temperature=1.0, top_p=1.0,
                           max_tokens=MAX_TOKENS, round_tokens=ROUND, seed=100 * step, version=step)
        out.append([(g.index, [(s.token_ids, s.versions, s.finish_reason) for s in g.samples]) for g in groups])
    return pool, out


def test_steps_return_finished_groups_in_admission_order_and_continue_the_rest(engines):
    make, v1 = engines
    pool, out = _run(make(), v1)
    for step, groups in enumerate(out):
        assert len(groups) == 3  # want
        indices = [i for i, _ in groups]
        assert indices == sorted(indices)  # admission (data) order among the finished ones
        for _, samples in groups:
            assert len(samples) == G
            for tokens, versions, finish in samples:
                assert finish == "stop" or len(tokens) == MAX_TOKENS  # finished
                assert len(versions) == len(tokens) and versions == sorted(versions)
    # every prompt of the data order taken once: the windows overlap, the pool never repeats one
    taken = [i for groups in out for i, _ in groups]
    assert len(taken) == len(set(taken))
    # over-sampling: the pool kept a group past the steps (capacity 4, 3 taken per step)
    assert len(pool.groups) + len(pool.waiting) >= 1
    # a response left unfinished when its step had enough groups was continued by the next step's
    # policy: its first tokens carry one version, its last a later one
    assert any(v[0] < v[-1] for groups in out for _, samples in groups for _, v, _ in samples)


def test_the_same_inputs_give_the_same_steps(engines):
    make, v1 = engines
    assert _run(make(), v1)[1] == _run(make(), v1)[1]


def test_stale_mask_keeps_the_tokens_of_the_bound():
    assert stale_mask([0, 0, 1, 2], oldest=1) == [False, False, True, True]
    assert stale_mask([2, 2], oldest=1) is None and stale_mask(None, oldest=1) is None
