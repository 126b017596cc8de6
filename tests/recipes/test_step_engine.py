"""Tier a: `stapo_megatron.recipes.step_engine` (one vLLM engine of the step model and the
rollout-schedule simulator) against timelines worked out by hand.

Every case uses a decode model where one iteration costs exactly 1 s whatever the batch (no KV or
per-sequence cost) and a prefill of ``prefill_s`` a context token, so the timeline can be
written down (the comments give it).
"""

from stapo_megatron.recipes import step_engine
from stapo_megatron.recipes import step_model as model


def _decode(kv_capacity_tokens=10**12, prefill_s=0.0, max_num_seqs=10**9):
    return model.DecodeModel(weight_s=1.0, kv_s_per_token=0.0, seq_s=0.0, prefill_s_per_token=prefill_s,
                             kv_capacity_tokens=kv_capacity_tokens, max_num_seqs=max_num_seqs)


def _finished(engine, **run):
    return [(t, seq.group, seq.tokens) for t, seq in engine.run(**run)]


def test_a_full_cache_preempts_the_newest_sequence_which_recomputes_its_context():
    # 6 context tokens, prefill 0.5 s a token; two responses of 3 to a 1-token prompt. A starts
    # 0-0.5, B 0.5-1 (1 + 1 + 2 next tokens <= 6); two iterations 1-3 bring the context to 6 and
    # the next tokens would need 8: B (the newest, 3 tokens) is preempted; A's last iteration
    # 3-4; B starts again and prefills its 3 tokens 4-5.5, its last iteration 5.5-6.5
    engine = step_engine.Engine(_decode(kv_capacity_tokens=6, prefill_s=0.5))
    engine.admit(model.Prompt(0, 1, [3, 3]), version=0)
    assert [t for t, _, _ in _finished(engine)] == [4.0, 6.5]
    assert (engine.preemptions, engine.recomputed_tokens, engine.peak_context) == (1, 3, 6)
    assert engine.busy_s == 6.5


def test_with_room_nothing_is_preempted():
    # the same two responses in an unbounded cache: prefills 0-1, three iterations 1-4
    engine = step_engine.Engine(_decode(prefill_s=0.5))
    engine.admit(model.Prompt(0, 1, [3, 3]), version=0)
    assert [t for t, _, _ in _finished(engine)] == [4.0, 4.0]
    assert (engine.preemptions, engine.recomputed_tokens, engine.peak_context) == (0, 0, 8)


def test_admission_leaves_room_for_the_running_sequences_next_tokens():
    # 3 context tokens: B's prompt would fit beside A's (1 + 1 <= 3) but not with A's next token
    # and its own (1 + 1 + 2 > 3), so B waits for A (0-2) and runs 2-4: no preemption
    engine = step_engine.Engine(_decode(kv_capacity_tokens=3))
    engine.admit(model.Prompt(0, 1, [2, 2]), version=0)
    assert [t for t, _, _ in _finished(engine)] == [2.0, 4.0]
    assert engine.preemptions == 0


def test_a_lone_sequence_is_never_preempted():
    # vLLM would refuse a prompt longer than the cache; a sequence that outgrows it alone runs on
    engine = step_engine.Engine(_decode(kv_capacity_tokens=2))
    engine.admit(model.Prompt(0, 1, [5]), version=0)
    assert [t for t, _, _ in _finished(engine)] == [5.0]
    assert (engine.preemptions, engine.peak_context) == (0, 6)


def test_an_engine_runs_at_most_max_num_seqs():
    engine = step_engine.Engine(_decode(max_num_seqs=1))
    engine.admit(model.Prompt(0, 1, [2, 4]), version=0)
    assert [t for t, _, _ in _finished(engine)] == [2.0, 6.0]


def test_a_preempted_sequence_keeps_the_versions_of_its_tokens():
    # 6 context tokens, two responses of 4 to 1-token prompts: 2 iterations 0-2 (context 6), B
    # is preempted with 2 tokens of version 0; the weights of version 1 load in flight 2-3; A
    # ends 3-5 (2 tokens of version 1); B restarts and makes its last 2 tokens 5-7 under version 1
    engine = step_engine.Engine(_decode(kv_capacity_tokens=6))
    engine.admit(model.Prompt(0, 1, [4, 4]), version=0)
    assert _finished(engine, until=2.0) == []
    engine.load(1, at=2.0, pause_s=1.0)
    assert _finished(engine) == [(5.0, 0, {0: 2, 1: 2}), (7.0, 0, {0: 2, 1: 2})]
    assert engine.preemptions == 1


def test_an_engine_that_runs_dry_idles_to_the_end_of_the_window():
    # started at 1, the response of 2 ends at 3 and the engine idles to 10; a response of 5
    # admitted then has 2 of its iterations done at 12
    engine = step_engine.Engine(_decode(), clock=1.0)
    engine.admit(model.Prompt(0, 1, [2]), version=0)
    assert _finished(engine, until=10.0) == [(3.0, 0, {0: 2})]
    assert (engine.clock, engine.num_sequences) == (10.0, 0)
    engine.admit(model.Prompt(1, 1, [5]), version=0)
    assert _finished(engine, until=12.0) == []
    assert (engine.clock, engine.num_sequences) == (12.0, 1)
