"""The per-token logit-gradient norm (ops/logit_grad.py) and the op's collision sum against autograd: the multi-process and end-to-end tests (the single-process ones and the helpers are in ``tests/ops/test_logit_grad.py``)."""

import dataclasses
import math
import pytest
import torch
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objective import policy_loss, token_objective
from stapo_megatron.ops import logit_grad
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.spiky_batch import _spiky_batch
from tests.ops.test_logit_grad import COLLISION_TOL, NORM_ATOL, NORM_RTOL, _autograd_row_norms, _objective_inputs, _ref_probs, _tp_worker  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.8])
def test_tp2_collision_and_norm_equal_full_vocabulary(temperature):
    outs = run_distributed(2, _tp_worker, temperature)
    logits, target, logprob, collision, num_calls, gen_state = outs[0]
    assert num_calls == outs[1][4] == 2, "the collision sum rides the op's MAX and packed SUM"
    torch.testing.assert_close(outs[1][3], collision, atol=0, rtol=0)
    expected = _ref_probs(logits, 600, temperature).square().sum(-1)
    torch.testing.assert_close(collision.double(), expected, atol=COLLISION_TOL, rtol=0)
    gen = torch.Generator()
    gen.set_state(gen_state)
    old, adv, is_weight, ref = _objective_inputs(logprob, gen)
    coef = logit_grad.logprob_coefficient(logprob, old, adv, 0.2, 0.28, None, is_weight)
    grad_sq = logit_grad.logit_grad_sq_norm(coef, logprob, collision, temperature)
    expected = _autograd_row_norms(logits, target, old, adv, temperature, 600, is_weight, ref, 0.0, None)
    torch.testing.assert_close(grad_sq.double(), expected, rtol=NORM_RTOL, atol=NORM_ATOL)
