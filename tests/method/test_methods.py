"""The method registry: every method is one `Method`, and a new one needs nothing but an entry."""

import pytest
import torch

from stapo_megatron.method import registry as methods
from stapo_megatron.launch.entry import build_config
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.recipes import paper
from tests.helpers.spiky_batch import _spiky_batch


def test_registry_names_and_statistics():
    assert tuple(methods.METHODS) == ("stapo", "justrl", "grpo", "entropy20", "random", "random_uniform")
    for name, method in methods.METHODS.items():
        assert method.name == name
    assert [m.needs_entropy for m in methods.METHODS.values()] == [True, False, False, True, True, True]
    assert [m.loss_agg for m in methods.METHODS.values()] == (
        ["token_mean", "token_mean", "seq_mean_token_mean"] + ["token_mean"] * 3)


def test_unknown_method_names_the_closest():
    with pytest.raises(ValueError, match=r"method must be one of \('stapo', 'justrl', 'grpo', 'entropy20', 'random', 'random_uniform'\), "
                                         r"got 'stappo' \(did you mean 'stapo'\?\)"):
        LossConfig(method="stappo")


def test_a_new_method_is_one_registry_entry(monkeypatch):
    """Registering a method is all it takes for the config, the recipes, the launch entry and the
    loss to accept it (the mask here: silence every response token with A < 0)."""
    def negative_mask(config, logprob, entropy, advantages, response_mask, threshold, seed):
        return response_mask & (advantages < 0)

    new = methods.Method("positive_only", "drop tokens of below-mean responses", negative_mask,
                         loss_options=dict(clip_ratio_high=0.2))
    monkeypatch.setitem(methods.METHODS, new.name, new)
    assert paper.method_loss("positive_only") == LossConfig(method="positive_only", **{**paper.PAPER_LOSS,
                                                                                        "clip_ratio_high": 0.2})
    cfg, _ = build_config("tiny", "positive_only")
    assert cfg.loss.method == "positive_only"
    logits, logprob, entropy, batch = _spiky_batch()
    config = cfg.loss
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, logprob, entropy, adv, mask)
    assert torch.isnan(threshold)
    loss_sum, num_kept, metrics = loss_func(config, batch, threshold, None, None, logits)
    keep = mask & (adv >= 0)
    assert num_kept.item() == keep.sum().item()
    assert metrics["stapo_sums"][3].item() == (mask & (adv < 0)).sum().item()
    # on-policy: every kept token contributes -A
    assert loss_sum.item() == pytest.approx(-(adv * keep).sum().item(), abs=1e-5)
