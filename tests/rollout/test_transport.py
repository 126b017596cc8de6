"""`stapo_megatron.rollout.transport`: the groups that cross the transport and the messages on them, with
three ranks (trainer 0, trainer 1, one engine) as threads of this process over one store."""

import torch
import torch.distributed as dist

from stapo_megatron.rollout.transport import Outbox, broadcast_object, broadcast_tensor, connect, receive
from tests.helpers.dist_utils import rank_threads


def _ranks(fn, world=3, engine_ranks=1):
    """Run ``fn(transport)`` on every rank of a job of ``world`` ranks (threads); their results."""
    store = dist.HashStore()
    return rank_threads(lambda rank: fn(connect(store, rank, world, engine_ranks, 1, samples_timeout_s=60)),
                        world, timeout=120)


def test_the_pools_and_their_groups():
    def describe(transport):
        return (transport.is_engine, transport.is_engine_leader, transport.control is not None, transport.data.size())

    assert _ranks(describe) == {0: (False, False, True, 3), 1: (False, False, False, 3), 2: (True, True, True, 3)}


def test_commands_reach_every_engine_and_samples_their_asker_in_order():
    def run(transport):
        if transport.rank == 0:  # trainer 0: two commands and a weight bucket, then its replies
            broadcast_object(transport.control, ("generate", 0))
            broadcast_object(transport.control, ("generate", 1))
            broadcast_tensor(transport.weights, torch.arange(6, dtype=torch.uint8))
            return [receive(transport.data, 2, 2, 60) for _ in range(2)]
        if transport.rank == 1:  # trainer 1: its own reply only
            return receive(transport.data, 2, 2, 60)
        commands = [broadcast_object(transport.control), broadcast_object(transport.control)]
        bucket = broadcast_tensor(transport.weights, torch.empty(6, dtype=torch.uint8))
        outbox = Outbox(transport.data)  # posted without waiting, in request order
        outbox.send(0, [0, 7], {"samples": "first"})
        outbox.send(1, [0, 8], ["for rank 1"])
        outbox.send(0, [1, 9], {"samples": "second"})
        outbox.close(60)
        return commands, bucket.tolist()

    results = _ranks(run)
    assert results[2] == ([("generate", 0), ("generate", 1)], [0, 1, 2, 3, 4, 5])
    assert results[0] == [([0, 7], {"samples": "first"}), ([1, 9], {"samples": "second"})]
    assert results[1] == ([0, 8], ["for rank 1"])


def test_receive_any_takes_each_message_from_the_rank_that_sent_it():
    """Two engines (ranks 1, 2 of a job with one trainer) post to trainer 0; it reads from
    whichever sent, each header with its own payload; the engines also hold the store view their
    streaming claims use."""
    from stapo_megatron.rollout.transport import receive_any

    def run(transport):
        if transport.rank == 0:
            return sorted(receive_any(transport.data, 2, 60) for _ in range(4)), transport.store is None
        outbox = Outbox(transport.data)
        for i in range(2):
            outbox.send(0, [transport.rank, i], f"from {transport.rank}, {i}")
        outbox.close(60)
        return transport.store.add("claims", 1) > 0

    results = _ranks(run, world=3, engine_ranks=2)
    assert results[0] == ([(1, [1, 0], "from 1, 0"), (1, [1, 1], "from 1, 1"), (2, [2, 0], "from 2, 0"),
                           (2, [2, 1], "from 2, 1")], True)
    assert results[1] is True and results[2] is True
