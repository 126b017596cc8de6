"""Fused log-probability and entropy on tensor-parallel vocabulary-sharded logits: the op.

STAPO needs, for every response token, log p(y_t) (differentiable: the policy-gradient term)
and the full-vocabulary entropy H_t (a constant: it only selects the S2T mask). With the output
layer column-parallel, rank r of the TP group holds logits for vocabulary ids
[r * V_local, (r + 1) * V_local). The op computes both without gathering logits:

    step 1  local pass (one read of the shard): per row the local max m_r and the sums relative
            to it, s_r = sum exp(z - m_r), w_r = sum exp(z - m_r) (z - m_r), the target logit z_y
            and, when asked (``with_collision``), q_r = sum exp(2 (z - m_r))
    step 2  all-reduce MAX of m_r                                  -> global reference M
    step 3  rescale to M and all-reduce SUM of the packed (s, w, z_y[, q])  -> S, W, z_y[, Q]
    step 4  normalise: log Z = M + log S, log p = z_y - log Z, H = log S - W / S, sum_v p_v^2 = Q / S^2

with z = logits / temperature. Steps 2-4 are ``combine``'s, shared by two implementations of
step 1 and the backward: ``torch_path`` (any device; the CPU path and the reference) and
``triton_path`` (chosen on CUDA tensors), whose forward reads each shard once and writes only [N]
outputs and whose backward reads the logits once and writes the gradient once. Backward needs no
collective (the column-parallel output layer all-reduces its input gradient itself) and runs once,
like Megatron's cross entropy (no retain_graph double backward). The input is not modified unless
the caller asks for it (``inplace_backward``; Megatron's vocab_parallel_cross_entropy always
overwrites fp32 logits, the cause of verl #1672/#2484) and no fp32 copy of the shard is held
beyond the returned gradient. ``entropy_grad`` lets a gradient flow into H too,
dH/dz = -p (log p + H).

The collision probability sum_v p_v^2 (at the same temperature) is what the squared norm of a
token's logit gradient needs: ||d log p(y) / dz||^2 = 1 - 2 p(y) + sum_v p_v^2
(``stapo_megatron.ops.logit_grad``). It rides in the packed SUM of step 3 (a fourth row of the
same all-reduce, so still 2 collectives), is a constant (no gradient) and changes neither the
log-prob, the entropy nor their gradients: it is one more sum over the probabilities step 1
already has in cache. The Triton forward always computes it (one more FMA per element of a
memory-bound pass); the torch path only when asked.

Masked vocabulary entries (logits = -inf) have p = 0 and contribute 0 log 0 = 0 to H; a shard
whose entries are all -inf contributes nothing. A row with no finite logit on any rank has no
distribution and gives NaN.

Legend: N = flattened tokens, V = local vocabulary shard size.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.ops.torch_path import LogprobEntropyTorch
from stapo_megatron.ops.triton_path import LogprobEntropyTriton

_IMPLS = ("auto", "torch", "triton")


def vocab_shard(vocab_local: int, tp_group: Optional[dist.ProcessGroup], vocab_size: Optional[int]):
    """This TP rank's place in a vocabulary-sharded output layer.

    Returns (tp_group or None when TP = 1, tp_size, tp_rank, real vocabulary size, number of
    real (non-padding) entries in this rank's shard). Raises if the shard holds only padding.
    """
    tp_size, tp_rank = 1, 0
    if tp_group is not None:
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if tp_size == 1:
            tp_group = None
    total = vocab_local * tp_size
    vocab_size = total if vocab_size is None else vocab_size
    if not 0 < vocab_size <= total:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {total}] (V_local {vocab_local} x TP {tp_size})")
    num_real = min(vocab_local, vocab_size - tp_rank * vocab_local)
    if num_real <= 0:
        raise ValueError(
            f"TP rank {tp_rank} holds only padding (vocab_size {vocab_size}, V_local {vocab_local}); "
            "reduce make_vocab_size_divisible_by"
        )
    return tp_group, tp_size, tp_rank, vocab_size, num_real


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    *,
    entropy_grad: bool = False,
    inplace_backward: bool = False,
    impl: str = "auto",
    with_collision: bool = False,
) -> Tuple[torch.Tensor, ...]:
    """Log-probability of ``target`` and full-vocabulary entropy from vocab-sharded logits.

    Args:
        logits: [..., V_local], fp32, bf16 or fp16. Rank r of ``tp_group`` holds vocabulary ids
            [r * V_local, (r + 1) * V_local). Never modified, unless ``inplace_backward``.
            Masked entries may be -inf (they get probability 0).
        target: [...] global token ids (an integer dtype).
        tp_group: tensor-parallel group over which the vocabulary is sharded; None = unsharded.
        temperature: logits are divided by it, exactly as the rollout sampler does (vLLM
            applies ``logits / temperature`` before softmax), so train and rollout log-probs
            are comparable. Finite and > 0.
        vocab_size: the real vocabulary size when the output layer is padded (Megatron pads to
            a multiple of make_vocab_size_divisible_by x TP): ids >= vocab_size are excluded
            from the softmax, as the tokenizer and vLLM never see them. None = no padding.
        entropy_grad: let a gradient flow into the entropy too (dH/dz = -p (log p + H) / T);
            by default it is a constant, as the S2T mask needs.
        inplace_backward: backward may write the gradient over ``logits``' storage (as Megatron's
            cross entropy does), so no second logits-sized buffer exists. Only when nothing else
            reads those logits after this op's backward.
        impl: "triton" (the kernels of ``stapo_megatron.ops.triton_kernels``: CUDA tensors,
            or Triton's interpreter), "torch" (any device; the reference), or "auto" = Triton on
            CUDA tensors when Triton is installed, torch otherwise.
        with_collision: also return the collision probability sum_v p_v^2 of softmax(logits / T)
            (a constant), for the per-token logit-gradient norm
            (``stapo_megatron.ops.logit_grad.logit_grad_sq_norm``).

    Returns:
        (logprob, entropy) or, with ``with_collision``, (logprob, entropy, collision): fp32
        tensors of ``target``'s shape. ``logprob`` = log softmax(logits / T)[target],
        differentiable w.r.t. ``logits``; ``entropy`` = -sum_v p log p of softmax(logits / T),
        detached unless ``entropy_grad``. Exactly 2 collectives over ``tp_group`` per call, none
        in backward.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be target shape {tuple(target.shape)} + [V_local]"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be floating point (fp32/bf16/fp16), got {logits.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    vocab_local = logits.shape[-1]
    tp_group, tp_size, tp_rank, vocab_size, num_real = vocab_shard(vocab_local, tp_group, vocab_size)
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(
            f"target ids must lie in [0, {vocab_size}) (V_local {vocab_local} x TP {tp_size}, "
            f"vocab_size {vocab_size}); got range [{int(target.min())}, {int(target.max())}]"
        )
    use_triton = impl == "triton" or (impl == "auto" and logits.is_cuda and _triton_installed())
    logits_NV = logits.reshape(-1, vocab_local)
    target_N = target.reshape(-1).long()
    if use_triton:  # the kernels index rows by stride and columns contiguously
        logits_NV = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
        target_N = target_N.contiguous()
    function = LogprobEntropyTriton if use_triton else LogprobEntropyTorch
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    logprob_N, entropy_N, collision_N = function.apply(
        logits_NV, target_N, tp_rank * vocab_local, num_real, 1.0 / float(temperature), tp_group,
        needs_grad, entropy_grad, inplace_backward, with_collision,
    )
    if with_collision:
        return logprob_N.view(target.shape), entropy_N.view(target.shape), collision_N.view(target.shape)
    return logprob_N.view(target.shape), entropy_N.view(target.shape)


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
