"""`stapo_megatron.rollout.remote`: how a request is split over the engines, how a weight bucket
travels, and how a streaming step takes its groups from what several engines post (threads of
this process over the real transport; the other multi-rank paths: tests/trainer/test_rollout_schedule.py and
tests/integration/test_separate_placement.py)."""

import threading

import pytest
import torch
import torch.distributed as dist

from stapo_megatron.rollout.remote import Chunk, bucket_bytes, plan_chunks, unpack_bucket
from tests.helpers.dist_utils import rank_threads


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


def _streamed(order, sequenced):
    """Trainer 0 (rank 0) takes two steps of 2 groups and one urgent group of 1 from what two
    engines (ranks 1, 2) sharing its replica's queue post: engine 1 queue entries 2 and 0 and an
    urgent group of ticket 5, engine 2 entries 3 and 1 (with ``sequenced``, only after the
    trainer took its first step). Returns the trainer's (positions, generate seconds) per take."""
    from stapo_megatron.rollout.remote import STREAMED, PoolRequest, RemoteEngine, Ticket
    from stapo_megatron.rollout.transport import Outbox, connect

    store, first_taken = dist.HashStore(), threading.Event()

    def post(outbox, ticket, index, urgent=False):
        reply = dict(group=f"group {index}", position=10 * index + 100 * urgent, index=index, urgent=urgent,
                     running=0, waiting=0)
        outbox.send(0, [ticket, STREAMED, 1000 * (index + 1), 0, 0], [reply])

    def rank_main(rank):
        transport = connect(store, rank, 3, 2, 1, samples_timeout_s=60)
        if rank == 0:
            remote = RemoteEngine(transport, asks=True, timeout_s=60, bucket_mb=1)
            chunks = [Chunk(0, 0, 0, 4, 0), Chunk(0, 1, 0, 4, 1)]
            taken = []
            for ticket, want, urgent in ((0, 2, False), (5, 1, True), (1, 2, False)):
                (reply,) = remote.receive(Ticket(ticket, 0, chunks, stream=PoolRequest(want, want, 0, urgent, order)))
                taken.append((reply["positions"], round(remote.last_times.generate, 3)))
                first_taken.set()
            return taken
        outbox = Outbox(transport.data)
        if rank == 1:
            for ticket, index, urgent in ((0, 2, False), (0, 0, False), (5, 0, True)):
                post(outbox, ticket, index, urgent)
        else:
            if sequenced:
                first_taken.wait(60)
            for index in (3, 1):
                post(outbox, 1, index)
        outbox.close(60)

    return rank_threads(rank_main, 3, timeout=120)[0]


def test_a_streaming_step_takes_the_next_groups_of_the_admission_queue_from_any_engine():
    # whichever engine posts first, the steps take queue entries 0, 1 then 2, 3 (the data order)
    assert _streamed("admission", sequenced=False) == [([0, 10], 0.003), ([100], 0.001), ([20, 30], 0.007)]


def test_a_streaming_step_takes_the_first_groups_to_arrive_in_completion_order():
    # engine 2 posts only after the first step: the first step takes engine 1's two, in their order
    assert _streamed("completion", sequenced=True) == [([20, 0], 0.004), ([100], 0.001), ([30, 10], 0.006)]


def test_an_adapter_travels_as_a_transfer_of_its_own_after_the_base():
    """Adapter-only sync to the engine ranks (``rollout.engine=vllm_lora``): trainer 0 queues the
    base as a ``weights`` transfer, then PEFT's tensors as an ``adapter`` transfer carrying the
    adapter's config, both of the policy version the schedule set; the engine rank receives them
    in that order, bucket by bucket, equal to what was sent (a thread per rank, the real transport)."""
    from stapo_megatron.rollout.remote import RemoteEngine
    from stapo_megatron.rollout.transport import broadcast_object, connect
    from stapo_megatron.serve.weight_receive import receive_weights

    base = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4)}
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    adapter = {f"{prefix}.lora_A.weight": torch.randn(2, 4), f"{prefix}.lora_B.weight": torch.randn(4, 2)}
    config = {"r": 2, "lora_alpha": 4.0}
    store = dist.HashStore()

    def rank_main(rank):
        transport = connect(store, rank, 2, 1, 1, samples_timeout_s=60)
        if rank == 0:
            remote = RemoteEngine(transport, asks=True, timeout_s=60, bucket_mb=1, serves_adapters=True)
            remote.policy_version = 3
            remote.update_weights(base.items())
            remote.load_adapter(adapter, config)
            return remote.transfers
        got = []
        for _ in range(2):
            command = broadcast_object(transport.control)
            got.append((command, {name: t.clone() for name, t in receive_weights(transport, torch.device("cpu"))}))
        return got

    results = rank_threads(rank_main, 2, timeout=120)
    (weights_command, got_base), (adapter_command, got_adapter) = results[1]
    assert weights_command == ("weights", 3) and adapter_command == ("adapter", 3, config)
    assert sorted(got_base) == sorted(base) and all(torch.equal(got_base[k], t) for k, t in base.items())
    assert sorted(got_adapter) == sorted(adapter) and all(torch.equal(got_adapter[k], t) for k, t in adapter.items())
    assert results[0] == 1, "the base and its adapter: one transfer of the policy"
