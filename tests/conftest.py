"""Fixtures shared by the test modules."""

import pytest

from tests.dist_utils import single_process_env


@pytest.fixture(scope="module")
def parallel():
    """Megatron's parallel state for one process (TP = PP = 1), for the module's tests."""
    from stapo_megatron.train.parallel import destroy_parallel, init_parallel

    with single_process_env():
        yield init_parallel(1, 1)
        destroy_parallel()
