"""Tier a: user methods (``method/registry.py``): one registered by ``@register_method`` and one
named only by its dotted path train a loss on the loss tests' batch, and reach the config from the
command line; bad paths and names give errors that name the field and the path."""

import dataclasses
import importlib

import pytest
import torch

from stapo_megatron.config.yaml_io import dump_config, parse_config
from stapo_megatron.launch.entry import build_config
from stapo_megatron.method import registry
from stapo_megatron.method.config import LossConfig, method_loss_config
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from tests.helpers.spiky_batch import _spiky_batch

PLUGIN = "tests.helpers.user_method_plugin"
"""The user's module (tests/helpers/user_method_plugin.py)."""
FP32_TOL = 1e-5
"""fp32 loss sums of at most 96 tokens of |A| <= 1."""


@pytest.fixture
def methods(monkeypatch):
    """A private copy of `registry.METHODS`, and the plugin imported afresh into it, so that the
    registration here leaves the built-in registry (and its order) as other tests expect it."""
    monkeypatch.setattr(registry, "METHODS", dict(registry.METHODS))
    importlib.reload(importlib.import_module(PLUGIN))
    return registry.METHODS


def _loss(config, batch, logits):
    """(loss_sum, num_kept, gradient of loss_sum wrt the logits) of ``config`` on ``batch``."""
    logits = logits.detach().clone().requires_grad_()
    logprob = batch.old_logprob
    _, entropy = vocab_parallel_logprob_entropy(logits.detach(), batch.labels)
    threshold = minibatch_threshold(config, logprob, entropy, batch.advantages, batch.response_mask)
    loss_sum, num_kept, _ = loss_func(config, batch, threshold, None, None, logits)
    loss_sum.backward()
    return loss_sum.item(), num_kept.item(), logits.grad


def test_a_decorated_method_trains_a_loss_by_name_and_by_dotted_path(methods):
    assert list(methods)[-1] == "positive_only"
    method = registry.get_method(f"{PLUGIN}:positive_only")
    assert method is methods["positive_only"] is registry.get_method(f"{PLUGIN}.positive_only")
    assert (method.summary, dict(method.loss_options), method.needs_entropy) == (
        "Silence every token of a below-mean response (A < 0).", {"clip_ratio_high": 0.2}, False)
    assert method_loss_config(f"{PLUGIN}:positive_only").clip_ratio_high == 0.2
    logits, _, _, batch = _spiky_batch()
    for name in ("positive_only", f"{PLUGIN}:positive_only"):
        loss_sum, num_kept, _ = _loss(LossConfig(method=name), batch, logits)
        keep = batch.response_mask & (batch.advantages >= 0)
        assert num_kept == keep.sum().item() == 4 * 9
        # on-policy (ratio 1): every kept token contributes -A = -1
        assert loss_sum == pytest.approx(-36.0, abs=FP32_TOL)


def test_a_plain_mask_function_by_dotted_path_trains_a_loss():
    """The plain mask silences the first response token: the same loss and gradient as justrl on
    a batch whose response starts one token later."""
    logits, _, _, batch = _spiky_batch()
    batch = dataclasses.replace(batch, advantages=batch.advantages * torch.linspace(0.5, 1.5, 8)[:, None])
    path = f"{PLUGIN}.silence_first_response_token"
    assert registry.get_method(path).name == path
    loss_sum, num_kept, grad = _loss(LossConfig(method=path), batch, logits)
    shorter = batch.response_mask.clone()
    shorter[:, 3] = False
    ref_sum, ref_kept, ref_grad = _loss(LossConfig(method="justrl"), dataclasses.replace(batch, response_mask=shorter),
                                        logits)
    assert num_kept == ref_kept == 8 * 8
    assert loss_sum == pytest.approx(ref_sum, abs=FP32_TOL)
    # on-policy (ratio 1): every kept token contributes -A; rows of A = +-0.5..1.5 do not cancel
    assert loss_sum == pytest.approx(-(batch.advantages * shorter).sum().item(), abs=FP32_TOL)
    # 4 row pairs (+s_2k, -s_2k+1) with s_i = 0.5 + i / 7, 8 kept tokens a row: -8 x 4 x (-1/7)
    assert loss_sum == pytest.approx(32 / 7, abs=FP32_TOL)
    torch.testing.assert_close(grad, ref_grad, atol=FP32_TOL, rtol=0)
    assert grad[:, 3].abs().sum().item() == 0.0  # the silenced token gets no gradient


def test_a_user_method_reaches_the_config_from_the_command_line_and_its_yaml():
    path = f"{PLUGIN}:positive_only"
    cfg, _ = build_config("tiny", **{"loss.method": path})
    assert (cfg.loss.method, cfg.loss.clip_ratio_high) == (path, 0.28)  # loss.method: the method alone
    switched, _ = build_config("tiny", f"{PLUGIN}.positive_only")  # method=: with its loss_options
    assert (switched.loss.method, switched.loss.clip_ratio_high) == (f"{PLUGIN}.positive_only", 0.2)
    _, again, _ = parse_config(dump_config(cfg, recipe="tiny"))
    assert again.loss.method == path


@pytest.mark.parametrize("path, message", [
    ("tests.no_such_module:fn", "loss.method = 'tests.no_such_module:fn' does not name an importable object: "
                                "cannot import module 'tests.no_such_module'"),
    (f"{PLUGIN}:missing", f"loss.method = '{PLUGIN}:missing' does not name an importable object: module "
                          f"'{PLUGIN}' has no attribute 'missing'"),
    (f"{PLUGIN}:NOT_A_METHOD", f"loss.method = '{PLUGIN}:NOT_A_METHOD' names a int, not a Method or a mask function"),
    ("pkg:", "loss.method = 'pkg:' is not a dotted path 'package.module:name'"),
])
def test_a_bad_dotted_path_names_the_field_and_the_path(path, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossConfig(method=path)


def test_a_name_taken_by_another_function_is_refused(methods):
    with pytest.raises(ValueError, match=r"method 'stapo' is already registered \(by stapo_megatron.method.registry."
                                         r"_stapo_mask\); choose another name for .*mine"):
        @registry.register_method("stapo")
        def mine(config, logprob, entropy, advantages, response_mask, threshold, seed):
            return response_mask
    assert methods["stapo"].mask is registry.METHODS["stapo"].mask
