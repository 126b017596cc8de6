"""Tier a: stapo-doctor's ``engine_start`` row (`stapo_megatron.doctor.engine.check_engine_start`)
on a machine without a GPU. (The vLLM rows need the engine: ``tests/integration/test_doctor.py``
and the GPU tier.)"""

from stapo_megatron.doctor import report


def test_engine_start_row_checks_every_paper_recipe_on_the_card():
    """On this CPU machine the row checks the 80 GiB card the memory model assumes; every paper
    recipe's engine starts there (the refusals themselves: tests/recipes/test_engine_memory.py)."""
    from stapo_megatron.doctor import engine

    row = engine.check_engine_start()
    assert (row.status, row.values["card_bytes"]) == (report.PASS, 80 * 2**30)
    assert "every paper recipe's engine starts on the model's 85.9 GB card" in row.detail
