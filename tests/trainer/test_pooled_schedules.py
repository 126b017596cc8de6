"""The rollout schedules behind one face: `build_schedule` picks each mode's class, a mode without
dynamic sampling refuses it by name, and a pooled mode resumed from a checkpoint without its
ledgers is refused by name (the trained schedules run in tests/trainer/test_rollout_schedule.py and
tests/integration/test_separate_placement.py, test_streaming_rollouts.py, test_streaming_requeue.py)."""

import pytest

from stapo_megatron.mcore.parallel import Groups
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.rollout.rollout_modes import MODES, SeparatePlacement
from stapo_megatron.trainer.pooled_schedules import (SCHEDULES, PartialSchedule, StreamingSchedule,
                                                     build_schedule)
from stapo_megatron.trainer.rollout_schedule import ColocatedSchedule, RolloutSchedule, SeparateSchedule

GROUPS = Groups(None, None, None, True, 0)


def _schedule(mode: str) -> RolloutSchedule:
    fields = {} if mode == "colocated" else dict(separate=SeparatePlacement(engine_ranks=1, max_staleness=1))
    return build_schedule(RolloutSampling(mode=mode, **fields), None, GROUPS, lambda s: [], str, lambda s: 0,
                          lambda engine, wake: {}, steps=1, timeout_s=1.0)


def test_each_mode_has_its_schedule_behind_one_face():
    assert tuple(SCHEDULES) == MODES
    classes = [type(_schedule(mode)) for mode in MODES]
    assert classes == [ColocatedSchedule, SeparateSchedule, PartialSchedule, StreamingSchedule]
    assert all(issubclass(c, RolloutSchedule) for c in classes)


@pytest.mark.parametrize("mode", ["colocated", "separate", "partial"])
def test_dynamic_sampling_is_refused_by_the_modes_without_it(mode):
    with pytest.raises(ValueError, match=f"rollout.streaming.filter_groups\\) needs rollout.mode='streaming', "
                                         f"not '{mode}'"):
        _schedule(mode).replace(0, [0], 0)


@pytest.mark.parametrize("mode", ["partial", "streaming"])
def test_a_pooled_resume_from_a_checkpoint_without_pool_ledgers_is_refused_by_name(mode):
    """A checkpoint saved in another mode holds no pool ledgers: resuming it pooled would lose the
    prompts in flight silently, so it is refused naming the setting."""
    with pytest.raises(ValueError, match=f"rollout.mode='{mode}' resumes from a checkpoint whose trainer state has "
                                         f"no pool ledgers .*resume it in another rollout mode"):
        _schedule(mode).load_state_dict({"step": 3})
