"""The rollout modes' sections: their own checks, the fields a mode does not read refused by name,
and the earlier flat keys refused with their spelling now, through the one override parser."""

import dataclasses

import pytest

from stapo_megatron.config import TrainerConfig
from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.rollout.rollout_modes import (MODE_SECTIONS, MODES, RENAMED_ROLLOUT_FIELDS, PartialRollouts,
                                                  SeparatePlacement, StreamingRollouts, changed_fields)


@pytest.mark.parametrize("build, message", [
    (lambda: SeparatePlacement(max_staleness=-1), "SeparatePlacement.max_staleness must be >= 0, got -1"),
    (lambda: SeparatePlacement(weight_bucket_mb=0), "SeparatePlacement.weight_bucket_mb must be >= 1, got 0"),
    (lambda: PartialRollouts(oversample=0.5), "rollout.partial.oversample must be >= 1, got 0.5"),
    (lambda: PartialRollouts(oversample=float("nan")), "rollout.partial.oversample must be >= 1, got nan"),
    (lambda: StreamingRollouts(order="fifo"), "rollout.streaming.order must be one of ('completion', 'admission')"),
    (lambda: StreamingRollouts(weight_load="later"), "rollout.streaming.weight_load must be one of"),
    (lambda: StreamingRollouts(reserve_tokens=0), "rollout.streaming.reserve_tokens must be None or an int >= 1, got 0"),
    (lambda: StreamingRollouts(reserve_tokens=2.5), "rollout.streaming.reserve_tokens must be None or an int >= 1"),
    (lambda: StreamingRollouts(filter_rounds=0), "StreamingRollouts.filter_rounds must be >= 1, got 0"),
])
def test_each_section_checks_its_own_fields(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        build()


def test_every_mode_but_colocated_reads_the_separate_section_and_its_own():
    assert MODES == ("colocated", "separate", "partial", "streaming")
    assert set(MODE_SECTIONS) == {"separate", "partial", "streaming"}
    assert changed_fields(StreamingRollouts()) == {}
    assert changed_fields(StreamingRollouts(order="admission", filter_rounds=2)) == {"order": "admission",
                                                                                     "filter_rounds": 2}
    partial = RolloutSampling(mode="partial", separate=SeparatePlacement(2, 1), partial=PartialRollouts(1.5, 64),
                              max_response_len=1000)
    assert partial.round_tokens == 64 and partial.num_engines == 2
    assert dataclasses.replace(partial, partial=PartialRollouts()).round_tokens == 250  # a quarter of the cap


@pytest.mark.parametrize("override, message", [
    ({"rollout.max_staleness": 2}, "rollout.max_staleness is now rollout.separate.max_staleness: write "
                                   "rollout.separate.max_staleness=2"),
    ({"rollout.stream_order": "admission"}, "rollout.stream_order is now rollout.streaming.order: write "
                                            "rollout.streaming.order='admission'"),
    ({"rollout.placement": "separate"}, "rollout.placement='separate' is no longer a setting: write "
                                        "rollout.mode='separate'"),
    ({"rollout.streaming": True}, "rollout.streaming=True is no longer a setting: write rollout.mode='streaming'"),
    ({"rollout.partial": True}, "rollout.partial=True is no longer a setting: write rollout.mode='partial'"),
    ({"rollout.mask_stale_tokens": True}, "write rollout.partial.max_token_age=<separate.max_staleness>"),
    ({"rollout.max_token_age": 3}, "write rollout.partial.max_token_age=3 or rollout.streaming.max_token_age=3"),
])
def test_the_earlier_flat_keys_are_refused_with_their_spelling_now(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        apply_overrides(TrainerConfig(), override)


def test_every_earlier_flat_key_is_renamed_and_none_is_a_field_now():
    fields = {f.name for f in dataclasses.fields(RolloutSampling)}
    assert RolloutSampling.RENAMED_FIELDS is RENAMED_ROLLOUT_FIELDS
    assert len(RENAMED_ROLLOUT_FIELDS) == 15
    assert set(RENAMED_ROLLOUT_FIELDS) & fields == {"partial", "streaming"}  # sections now: a value names the mode


def test_a_mode_and_its_sections_are_set_by_nested_overrides():
    cfg = apply_overrides(TrainerConfig(), {"rollout.mode": "streaming", "rollout.separate.engine_ranks": 1,
                                            "rollout.separate.max_staleness": 2, "rollout.streaming.order": "admission"})
    r = cfg.rollout
    assert (r.mode, r.separate.max_staleness, r.streaming.order, r.placement) == ("streaming", 2, "admission", "separate")
    with pytest.raises(ValueError, match=r"rollout\.streaming\.order='admission' needs rollout\.mode='streaming'"):
        apply_overrides(TrainerConfig(), {"rollout.streaming.order": "admission"})
