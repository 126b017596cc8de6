"""Tier a: the step's one record (`batch.step_rollout.StepRollout`): built from the engines' groups
flat in (prompt, sample) order with each sample's prompt, answer and token versions; the scorer's,
the metrics' and the routing monitor's views of it; its groups, and a group replaced by another
prompt's; bad groups named."""

import dataclasses

import pytest
import torch

from stapo_megatron.batch.step_rollout import RolloutSample, StepRollout
from stapo_megatron.rollout.base import Sample

ANSWERS = {7: "8", 3: "5"}


def _sample(ids, text="", versions=None, routes=None):
    return Sample(token_ids=ids, logprobs=[-0.5] * len(ids), text=text, finish_reason="stop", versions=versions,
                  routed_experts=routes)


def test_groups_become_one_flat_record_in_prompt_then_sample_order():
    groups = [[_sample([1], "a"), _sample([2, 3], "b")], [_sample([4, 5, 6], "c"), _sample([], "d")]]
    rollout = StepRollout.of_groups(4, [(7, [9, 9]), (3, [8])], ANSWERS.get, groups, 2, version=2)
    assert (rollout.step, rollout.version, rollout.num_prompts) == (4, 2, 2)
    assert rollout.prompt_indices == [7, 3]
    assert [s.prompt_ids for s in rollout.samples] == [(9, 9), (9, 9), (8,), (8,)]
    assert rollout.texts == ["a", "b", "c", "d"] and rollout.answers == ["8", "8", "5", "5"]
    assert rollout.response_tokens == 6
    # one policy sampled the request: every token carries its version
    assert [s.versions for s in rollout.samples] == [(2,), (2, 2), (2, 2, 2), ()]
    assert rollout.token_versions == [2] * 6
    assert rollout.samples[3].oldest(default=rollout.version) == 2  # an empty response: the request's
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.version = 3


def test_partial_rollouts_keep_the_token_versions_and_the_step_takes_the_oldest():
    groups = [[_sample([1, 2, 3], versions=[4, 5, 5]), _sample([6], versions=[5])]]
    rollout = StepRollout.of_groups(6, [(7, [1])], ANSWERS.get, groups, 2)
    assert rollout.version == 4 and rollout.token_versions == [4, 5, 5, 5]
    first = rollout.samples[0]
    assert first.oldest(default=0) == 4
    assert first.keep_mask(5) == [False, True, True] and first.keep_mask(4) is None


def test_routes_are_the_samples():
    routes = torch.zeros(3, 2, 1, dtype=torch.long)
    rollout = StepRollout.of_groups(0, [(7, [1, 2])], ANSWERS.get, [[_sample([4, 5], routes=routes),
                                                                     _sample([6, 7])]], 2, version=0)
    assert rollout.samples[0].routes is routes and rollout.samples[1].routes is None


def test_bad_groups_are_named():
    with pytest.raises(ValueError, match="1 sample groups for 2 prompts"):
        StepRollout.of_groups(0, [(7, [1]), (3, [2])], ANSWERS.get, [[_sample([1])] * 2], 2, version=0)
    with pytest.raises(ValueError, match="prompt 7 has 1 samples, not group_size=2"):
        StepRollout.of_groups(0, [(7, [1])], ANSWERS.get, [[_sample([1])]], 2, version=0)
    with pytest.raises(ValueError, match="carries no token versions"):
        StepRollout.of_groups(0, [(7, [1])], ANSWERS.get, [[_sample([1])] * 2], 2)
    with pytest.raises(ValueError, match="2 versions for 1 response tokens"):
        RolloutSample(7, (1,), "8", _sample([1]), (0, 0))
    one = RolloutSample(7, (1,), "8", _sample([1]), (0,))
    with pytest.raises(ValueError, match="3 samples do not form groups of group_size=2"):
        StepRollout(0, 0, 2, (one,) * 3)
    other = dataclasses.replace(one, prompt_index=3)
    with pytest.raises(ValueError, match=r"group 0 mixes prompts \[3, 7\]"):
        StepRollout(0, 0, 2, (one, other))


def test_groups_are_each_prompts_samples_and_a_replaced_group_gives_a_new_record():
    groups = [[_sample([1], "a", [5]), _sample([2, 3], "b", [4, 5])], [_sample([4], "c", [5]), _sample([], "d", [])]]
    rollout = StepRollout.of_groups(6, [(7, [9]), (3, [8])], ANSWERS.get, groups, 2)
    assert [[s.sample.text for s in group] for group in rollout.groups()] == [["a", "b"], ["c", "d"]]
    assert rollout.version == 4
    other = StepRollout.of_groups(9, [(5, [1])], ANSWERS.get, [[_sample([6], "e", [6]), _sample([7], "f", [6])]], 2)
    (new,) = other.groups()
    replaced = rollout.replace_group(0, new)
    assert replaced.prompt_indices == [5, 3] and replaced.texts == ["e", "f", "c", "d"]
    assert (replaced.step, replaced.version) == (6, 5)  # the oldest token left is group 1's version 5
    assert rollout.texts == ["a", "b", "c", "d"] and rollout.version == 4  # the record itself is unchanged
    again = replaced.replace_group(1, new)
    assert again.prompt_indices == [5, 5] and again.version == 6
    empty = StepRollout.of_groups(0, [(7, [1])], ANSWERS.get, [[_sample([], versions=[])] * 2], 2, version=3)
    assert empty.replace_group(0, empty.samples).version == 3  # no token: the record's version
    with pytest.raises(ValueError, match="group 2 of a step of 2 groups"):
        rollout.replace_group(2, new)
    with pytest.raises(ValueError, match="1 samples replace group 0, not group_size=2"):
        rollout.replace_group(0, new[:1])
    with pytest.raises(ValueError, match=r"group 0 mixes prompts \[5, 7\]"):
        rollout.replace_group(0, (new[0], rollout.samples[0]))
