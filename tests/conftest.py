"""Fixtures shared by the test modules."""

import sys

import pytest

from tests.dist_utils import one_rank_parallel


def _default_group_initialised() -> bool:
    # a test that never imported torch.distributed cannot have formed a group: no torch import here
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_initialized()


@pytest.fixture(autouse=True, scope="module")
def _no_group_left_by_module(request):
    """Fail the module whose fixtures leave a default process group formed (autouse module
    fixtures are set up first and torn down last, so this runs after `parallel`'s teardown)."""
    yield
    if _default_group_initialised():
        sys.modules["torch.distributed"].destroy_process_group()  # the next module starts clean
        pytest.fail(f"{request.node.nodeid} left a default torch.distributed process group initialised")


@pytest.fixture(autouse=True)
def _no_group_left_by_test(request):
    """Fail the test that forms a default process group in the pytest process and leaves it:
    the next test to call ``init_process_group`` here would fail, or `init_parallel` would
    silently reuse it. Groups of module fixtures (`parallel`) are formed before this runs."""
    before = _default_group_initialised()
    yield
    if not before and _default_group_initialised():
        sys.modules["torch.distributed"].destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default torch.distributed process group initialised")


@pytest.fixture(scope="module")
def parallel():
    """Megatron's parallel state for one process (TP = PP = 1), for the module's tests."""
    with one_rank_parallel() as groups:
        yield groups
