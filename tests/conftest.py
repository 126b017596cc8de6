"""Fixtures shared by the test modules."""

import pytest
import torch.distributed as dist

from tests.helpers.dist_utils import one_rank_parallel


def _fail_left_group(nodeid: str) -> None:
    dist.destroy_process_group()  # so that the next test starts clean
    pytest.fail(f"{nodeid} left a default torch.distributed process group initialised")


@pytest.fixture(autouse=True, scope="module")
def _no_group_left_by_module(request):
    """Fail the module whose fixtures leave a default process group formed (autouse module
    fixtures are set up first and torn down last, so this runs after `parallel`'s teardown)."""
    yield
    if dist.is_initialized():
        _fail_left_group(request.node.nodeid)


@pytest.fixture(autouse=True)
def _no_group_left_by_test(request):
    """Fail the test that forms a default process group in the pytest process and leaves it:
    the next test to call ``init_process_group`` here would fail, or `init_parallel` would
    silently reuse it. Groups of module fixtures (`parallel`) are formed before this runs."""
    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        _fail_left_group(request.node.nodeid)


@pytest.fixture(scope="module")
def parallel():
    """Megatron's parallel state for one process (TP = PP = 1), for the module's tests."""
    with one_rank_parallel() as groups:
        yield groups
