"""Tier c: what only a GPU can show (skipped on CPU machines)."""

import pytest
import torch

from stapo_megatron.ops import vocab_parallel_logprob_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_op_matches_cpu(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 151936, generator=gen) * 3).to(dtype)
    target = torch.randint(0, 151936, (64,), generator=gen)
    cpu = logits.clone().requires_grad_()
    lp_cpu, h_cpu = vocab_parallel_logprob_entropy(cpu, target, temperature=0.7)
    lp_cpu.sum().backward()
    gpu = logits.cuda().requires_grad_()
    lp_gpu, h_gpu = vocab_parallel_logprob_entropy(gpu, target.cuda(), temperature=0.7)
    lp_gpu.sum().backward()
    # both accumulate in fp32; only the reduction order differs
    torch.testing.assert_close(lp_gpu.cpu(), lp_cpu.detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(h_gpu.cpu(), h_cpu, atol=1e-4, rtol=0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gpu.grad.cpu().float(), cpu.grad.float(), atol=tol, rtol=0)
