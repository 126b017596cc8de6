"""Tier a: the chunked gated delta rule (stapo_megatron/mcore/delta_rule.py) against the token-by-token
recurrence (the doctor's `recurrent_delta_rule`): outputs and final states in float64 and fp32,
ragged lengths, initial states, packed sequences (``cu_seqlens``), gradients (gradcheck, and
autograd through the recurrence), megatron-core's own torch reference, and the CPU shim's choice."""

import pytest
import torch
import torch.nn.functional as F

from stapo_megatron.doctor.kernels import recurrent_delta_rule
from stapo_megatron.mcore import delta_rule
from stapo_megatron.mcore.delta_rule import chunk_gated_delta_rule

F64_TOL = 1e-12
"""Max error over the reference's max, float64: eps 2.2e-16 times a few thousand rounding steps
(150 tokens, dims 16, a 64 x 64 triangular solve), with room; a wrong term is O(1)."""
F32_TOL = 1e-5
"""fp32 against the float64 recurrence: eps 1.2e-7 times ~100 accumulated roundings (150 tokens,
the same triangular solve); tighter than the doctor's `DELTA_RULE_TOL`, which also covers fla's kernels."""


def _inputs(batch, tokens, heads=3, dim_k=16, dim_v=8, dtype=torch.float64, seed=0):
    """q, k unit-norm (the layer L2-normalises them), log decays < 0, write strengths in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, tokens, heads, dim_k, generator=gen, dtype=dtype), dim=-1)
            for _ in range(2))
    v = torch.randn(batch, tokens, heads, dim_v, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(batch, tokens, heads, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(batch, tokens, heads, generator=gen, dtype=dtype))
    state = torch.randn(batch, heads, dim_k, dim_v, generator=gen, dtype=dtype)
    return (q, k, v, g, beta), state


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 64, 150])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_float64_equals_the_recurrence(tokens, chunk_size):
    """Whole, ragged and single-chunk lengths, from a random initial state: outputs and the final state."""
    x, state = _inputs(2, tokens)
    want, want_state = recurrent_delta_rule(*x, initial_state=state, return_state=True)
    got, got_state = chunk_gated_delta_rule(*x, chunk_size=chunk_size, initial_state=state, output_final_state=True)
    assert got.dtype == got_state.dtype == torch.float64 and got.shape == want.shape
    assert _rel(got, want) < F64_TOL and _rel(got_state, want_state) < F64_TOL


def test_fp32_within_its_bound_and_bf16_in_fp32():
    """fp32 inputs against the float64 recurrence; bf16 inputs run in fp32 and return bf16 outputs
    (fla's contract: the state in fp32)."""
    x, _ = _inputs(2, 150, heads=4, dim_k=32, dim_v=32)
    want = recurrent_delta_rule(*x)
    got, none = chunk_gated_delta_rule(*(t.float() for t in x))
    assert got.dtype == torch.float32 and none is None
    assert _rel(got.double(), want) < F32_TOL
    out, state = chunk_gated_delta_rule(*(t.bfloat16() for t in x), output_final_state=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_megatron_references_agree():
    """The same fp32 result as megatron-core's ``torch_chunk_gated_delta_rule`` (the kernel it replaces)."""
    from megatron.core.ssm import gated_delta_net

    reference = getattr(gated_delta_net, "common", gated_delta_net).torch_chunk_gated_delta_rule
    x, state = _inputs(1, 100, heads=4, dim_k=32, dim_v=32, dtype=torch.float32)
    want, want_state = reference(*x, initial_state=state, output_final_state=True)
    got, got_state = chunk_gated_delta_rule(*x, initial_state=state, output_final_state=True)
    assert _rel(got, want) < F32_TOL and _rel(got_state, want_state) < F32_TOL


def test_packed_sequences_restart_their_state():
    """``cu_seqlens``: each packed sequence as the recurrence alone from its own initial state, final
    states one per sequence."""
    lengths = [5, 70, 1, 33]
    x, _ = _inputs(1, sum(lengths))
    states = _inputs(len(lengths), 1, seed=1)[1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got, got_states = chunk_gated_delta_rule(*x, chunk_size=16, initial_state=states, output_final_state=True,
                                             cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        want, want_state = recurrent_delta_rule(*(t[:, a:b] for t in x), initial_state=states[i: i + 1],
                                                return_state=True)
        assert _rel(got[:, a:b], want) < F64_TOL and _rel(got_states[i: i + 1], want_state) < F64_TOL


def test_qk_l2norm_in_kernel():
    """``use_qk_l2norm_in_kernel``: the same as normalising q and k first (fla's eps 1e-6 on the squared norm)."""
    x, _ = _inputs(1, 40)
    q, k = 3.0 * x[0], 0.5 * x[1]  # unit rows scaled: the kernel's norm undoes it
    got, _ = chunk_gated_delta_rule(q, k, *x[2:], use_qk_l2norm_in_kernel=True)
    want = recurrent_delta_rule(*(t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k)), *x[2:])
    assert _rel(got, want) < F64_TOL


def test_gradcheck():
    """Every input's gradient (q, k, v, g, beta, the initial state) and the final state's, float64,
    two chunks and a ragged one."""
    x, state = _inputs(1, 9, heads=2, dim_k=3, dim_v=2)
    args = [t.clone().requires_grad_() for t in (*x, state)]

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=s0, output_final_state=True)

    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_gradients_equal_the_recurrences():
    """Autograd through the chunked form and through the recurrence (float64, 100 tokens, chunk 64,
    packed into two sequences) give the same input gradients."""
    x, _ = _inputs(1, 100, heads=2)
    weight = torch.randn(1, 100, 2, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cu = torch.tensor([0, 70, 100])
    grads = []
    for packed in (True, False):
        args = [t.clone().requires_grad_() for t in x]
        if packed:
            out, _ = chunk_gated_delta_rule(*args, cu_seqlens=cu)
        else:
            out = torch.cat([recurrent_delta_rule(*(t[:, a:b] for t in args)) for a, b in ((0, 70), (70, 100))], 1)
        (out * weight).sum().backward()
        grads.append([t.grad for t in args])
    for got, want in zip(*grads):
        assert _rel(got, want) < F64_TOL


def test_shape_errors_name_the_shapes():
    x, _ = _inputs(2, 8)
    with pytest.raises(ValueError, match=r"beta \(2, 8\)"):
        chunk_gated_delta_rule(*x[:4], x[4][:, :, 0])
    with pytest.raises(ValueError, match="batch of 1, got batch 2"):
        chunk_gated_delta_rule(*x, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match=r"initial_state \(1, 3, 16, 8\)"):
        chunk_gated_delta_rule(*x, initial_state=torch.zeros(1, 3, 16, 8, dtype=torch.float64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim installs nothing on CUDA")
def test_the_cpu_shim_installs_it():
    from megatron.core.ssm import gated_delta_net

    from stapo_megatron.mcore import cpu_compat

    cpu_compat.apply()
    module = getattr(gated_delta_net, "common", gated_delta_net)
    assert module.chunk_gated_delta_rule is delta_rule.chunk_gated_delta_rule
