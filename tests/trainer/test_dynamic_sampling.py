"""Dynamic sampling (`stapo_megatron.trainer.dynamic_sampling`) on a one-rank gloo group: groups
whose rewards are all equal are replaced at their places, round after round, by the replacement
groups the schedule returns, scored with the real boxed exact-match reward; the rounds stop when
none is left or at the cap, and the metrics count what was dropped. (End to end with the real
engines and trainer: tests/integration/test_streaming_rollouts.py.)"""

import pytest
import torch
import torch.distributed as dist

from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.rewards.functions import boxed_exact_match
from stapo_megatron.rollout.base import Sample
from stapo_megatron.trainer.dynamic_sampling import fill_informative, uniform_groups
from tests.helpers.dist_utils import single_process_env

G = 2


@pytest.fixture
def gloo():
    with single_process_env():
        dist.init_process_group("gloo")
        try:
            yield
        finally:
            dist.destroy_process_group()


def _rollout(index_texts, version=3) -> StepRollout:
    """A record of one group per (training-set index, its G responses), tokens of ``version``."""
    groups = [[Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], text=t, finish_reason="stop", versions=[version] * 2)
               for t in texts] for _, texts in index_texts]
    return StepRollout.of_groups(0, [(i, [i]) for i, _ in index_texts], lambda i: str(i), groups, G)


def _score(rollout: StepRollout):
    rewards = [boxed_exact_match(t, a)[0] for t, a in zip(rollout.texts, rollout.answers)]
    return torch.tensor(rewards).view(rollout.num_prompts, G), {"num_timeouts": 0, "scored": len(rewards)}


def test_uniform_groups_are_those_whose_rewards_are_all_equal():
    assert uniform_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])) == [0, 2]


def test_uniform_groups_are_replaced_in_place_until_none_is_left(gloo):
    # groups 0 and 2 all wrong, group 1 informative
    rollout = _rollout([(0, ["\\boxed{9}", "\\boxed{9}"]), (1, ["\\boxed{1}", "\\boxed{5}"]), (2, ["x", "y"])])
    rewards, info = _score(rollout)
    asked = []
    replacements = iter([
        _rollout([(10, ["\\boxed{10}", "\\boxed{10}"]), (11, ["\\boxed{11}", "no"])], version=2),  # 10 all right
        _rollout([(12, ["\\boxed{0}", "\\boxed{12}"])], version=4),
    ])

    def replace(slots, round_index):
        asked.append((list(slots), round_index))
        return next(replacements)

    out, out_rewards, out_info, metrics = fill_informative(rollout, rewards, info, replace, _score, 4, None, "cpu")
    assert asked == [([0, 2], 0), ([0], 1)]  # round 1 replaced group 0's replacement (all right) again
    assert out.prompt_indices == [12, 1, 11] and out.num_prompts == 3
    assert uniform_groups(out_rewards) == [] and out_rewards.tolist() == [[-1.0, 1.0], [1.0, -1.0], [1.0, -1.0]]  # the +1/-1 reward
    assert out.version == 2  # the oldest token among the groups trained
    assert out_info["scored"] == 6 + 4 + 2
    assert metrics == dict(filter_dropped_groups=3.0, filter_drop_rate=3 / 6, filter_rounds=2.0,
                           filter_uniform_left=0.0)


def test_the_rounds_stop_at_the_cap_and_the_uniform_groups_left_train(gloo):
    rollout = _rollout([(0, ["a", "b"]), (1, ["\\boxed{1}", "c"])])
    rewards, info = _score(rollout)
    calls = []

    def replace(slots, round_index):
        calls.append(round_index)
        return _rollout([(20 + round_index, ["d", "e"])])  # all wrong again

    out, out_rewards, _, metrics = fill_informative(rollout, rewards, info, replace, _score, 2, None, "cpu")
    assert calls == [0, 1] and out.prompt_indices == [21, 1]
    assert metrics["filter_rounds"] == 2 and metrics["filter_uniform_left"] == 1 and metrics["filter_dropped_groups"] == 2


def test_a_step_without_uniform_groups_asks_for_nothing(gloo):
    rollout = _rollout([(1, ["\\boxed{1}", "c"])])
    rewards, info = _score(rollout)

    def replace(slots, round_index):
        raise AssertionError("nothing to replace")

    out, _, _, metrics = fill_informative(rollout, rewards, info, replace, _score, 4, None, "cpu")
    assert (out.samples, out.version) == (rollout.samples, rollout.version)
    assert metrics == dict(filter_dropped_groups=0.0, filter_drop_rate=0.0, filter_rounds=0.0, filter_uniform_left=0.0)
