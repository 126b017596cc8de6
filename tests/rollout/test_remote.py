"""`stapo_megatron.rollout.remote`'s pure parts: how a request is split over the engines and how a
weight bucket travels (the multi-rank paths: tests/trainer/test_rollout_schedule.py and
tests/integration/test_separate_placement.py)."""

import pytest
import torch

from stapo_megatron.rollout.remote import Chunk, bucket_bytes, plan_chunks, unpack_bucket


def test_each_asker_goes_whole_to_an_engine_when_engines_do_not_outnumber_askers():
    # ranks 0 and 2 ask (the first ranks of their model-parallel groups), rank 1 does not
    assert plan_chunks([6, None, 6], 1) == [Chunk(0, 0, 0, 6, 0), Chunk(2, 0, 0, 6, 0)]
    assert plan_chunks([6, None, 6], 2) == [Chunk(0, 0, 0, 6, 0), Chunk(2, 0, 0, 6, 1)]
    assert [c.engine for c in plan_chunks([4] * 4, 3)] == [0, 1, 2, 0]


def test_more_engines_than_askers_split_each_askers_prompts():
    chunks = plan_chunks([5, 5], 3)  # ceil(3 / 2) = 2 slices each, round robin over the engines
    assert [(c.dest, c.index, c.start, c.end, c.engine) for c in chunks] == [
        (0, 0, 0, 2, 0), (0, 1, 2, 5, 1), (1, 0, 0, 2, 2), (1, 1, 2, 5, 0)]
    # every prompt of every asker in exactly one slice
    for rank in (0, 1):
        mine = [c for c in chunks if c.dest == rank]
        assert [c.start for c in mine] == [0] + [c.end for c in mine[:-1]] and mine[-1].end == 5
    assert plan_chunks([None, None], 2) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucket_unpacks_to_the_tensors_sent(dtype):
    tensors = [("a.weight", torch.randn(3, 4).to(dtype)), ("b.bias", torch.randn(5).to(dtype)),
               ("c.weight", torch.randn(2, 2, 2).to(dtype))]
    manifest = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in tensors])
    assert bucket_bytes(manifest) == flat.numel() == 25 * tensors[0][1].element_size()
    for (name, sent), (got_name, got) in zip(tensors, unpack_bucket(manifest, flat.clone())):
        assert got_name == name and got.dtype == dtype and torch.equal(got, sent)


def test_a_sliced_streaming_request_shares_its_groups_as_the_prompts_are_sliced():
    from stapo_megatron.rollout.remote import plan_chunks, share

    plan = plan_chunks([16, None, 10], 5)  # two askers, five engines: three slices each
    for dest, total in ((0, 16), (2, 10)):
        mine = [c for c in plan if c.dest == dest]
        assert [share(total, c, plan) for c in mine] == [c.end - c.start for c in mine]
        assert sum(share(total, c, plan) for c in mine) == total
