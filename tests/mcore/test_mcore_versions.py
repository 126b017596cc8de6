"""Tier a: the megatron-core version checks of `mcore.mcore_versions` and its one private torch call."""

import types

import megatron.core
import pytest
import torch
from packaging.version import Version

from stapo_megatron.mcore import mcore_versions


def test_release_is_the_installed_version():
    assert mcore_versions.mcore_release() == Version(megatron.core.__version__).release[:3]
    assert (0, 16) <= mcore_versions.mcore_release()[:2] <= (0, 19)


@pytest.mark.parametrize("release, factor", [((0, 16, 1), 1), ((0, 18, 0), 1), ((0, 19, 0), 4), ((0, 19, 2), 4)])
def test_router_token_factor_follows_the_release(monkeypatch, release, factor):
    """0.19.0's router pre-multiplies the aux loss by the TP x CP size (4 here); 0.16-0.18 do not."""
    monkeypatch.setattr(mcore_versions, "mcore_release", lambda: release)
    router = types.SimpleNamespace(tp_cp_group=types.SimpleNamespace(size=lambda: 4))
    assert mcore_versions.router_aux_loss_token_factor(router) == factor


def test_missing_te_names_are_none_without_transformer_engine():
    from megatron.core.transformer.moe import moe_utils

    mcore_versions.define_missing_te_names()
    if getattr(moe_utils, "HAVE_TE", True):
        pytest.skip("transformer-engine imports: the names are upstream's")
    assert moe_utils.te_general_gemm is None and moe_utils.fused_topk_with_score_function is None


def test_in_backward_is_true_only_during_a_backward_pass():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", mcore_versions.in_backward()))
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", mcore_versions.in_backward()))
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [("forward", False), ("backward", True)]
    assert not mcore_versions.in_backward()


@pytest.mark.parametrize("release, packed", [((0, 16, 1), False), ((0, 17, 0), False), ((0, 18, 0), True),
                                             ((0, 19, 2), True)])
def test_delta_net_takes_packed_input_from_0_18(monkeypatch, release, packed):
    monkeypatch.setattr(mcore_versions, "mcore_release", lambda: release)
    assert mcore_versions.delta_net_takes_packed() is packed


@pytest.mark.parametrize("release, cp", [((0, 16, 1), False), ((0, 18, 0), False), ((0, 19, 0), True),
                                         ((0, 19, 2), True)])
def test_delta_net_has_context_parallel_from_0_19(monkeypatch, release, cp):
    monkeypatch.setattr(mcore_versions, "mcore_release", lambda: release)
    assert mcore_versions.delta_net_has_context_parallel() is cp


def test_delta_net_modules_are_where_the_layer_reads_fla_names():
    """0.16.1: the one module; 0.19.2: gdn.py (GatedDeltaNet) and common.py (its base class)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    names = [m.__name__ for m in mcore_versions.delta_net_modules()]
    assert names[0] == GatedDeltaNet.__module__
    if mcore_versions.mcore_release()[:2] >= (0, 19):
        assert names == ["megatron.core.ssm.gated_delta_net.gdn", "megatron.core.ssm.gated_delta_net.common"]
    else:
        assert names == ["megatron.core.ssm.gated_delta_net"]
