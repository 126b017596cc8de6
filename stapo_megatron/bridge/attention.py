"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local spec.

Megatron's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix (a 16k
token micro-batch of a 16-head layer would need 16 GiB for the scores alone in bf16); PyTorch's
SDPA dispatches to flash / cuDNN / memory-efficient kernels on GPU that never do. `SDPAttention`
is a drop-in for ``DotProductAttention`` in the local layer spec: same constructor arguments,
same forward contract, no parameters or buffers of its own (checkpoint keys are unchanged).
It is the default on CUDA without transformer-engine (`stapo_megatron.bridge.model.layer_spec`)
and selectable on CPU, where a test shows it equals the local attention on the same weights.

Layouts (Megatron's): query [sq, b, np, hn], key/value [sk, b, ng, hn] with np heads and ng
query groups on this TP rank; output [sq, b, np * hn]. SDPA's layout is [b, heads, s, hn].

Supported: causal self-attention (``attention_mask`` None, as the trainer passes; the mask
type is causal) or an explicit boolean mask (True = masked out, Megatron's convention), GQA,
dropout, and packed sequences (``PackedSeqParams(qkv_format="thd")``: query [t, np, hn],
key/value [t, ng, hn], causal within each sequence of ``cu_seqlens``, nothing across them).
Packed paths: on CUDA in fp16/bf16 without dropout, ``torch.nn.attention.varlen.varlen_attn``
(flash attention over ``cu_seqlens``, no t x t mask) where the installed torch has it; otherwise
(the CPU, fp32, dropout, older torch) the reference path: SDPA over each sequence alone, which is
what the padded batch computed for it (its pad keys were masked out by causality).

Context parallelism (``context_parallel_size`` > 1, packed rows only): the THD row holds this
CP rank's two chunks of every sequence (``stapo_megatron.batch.context_parallel``: chunks r and
2 CP - 1 - r, ``cu_seqlens`` those of the whole row), as Megatron lays it out for TE. K and V
are all-gathered over the CP group (Llama 3's all-gather CP; the backward sums their gradients
over CP and keeps this rank's slice: a reduce-scatter) and put back in each sequence's global
order; each query chunk then attends to its sequence's keys up to the chunk's end with a
lower-right-aligned causal mask (`chunk_attention`), so every query sees exactly the keys it
sees without CP. Cost per rank: the whole row's K and V per layer (ng x hn per token, kept for
backward), and two SDPA calls per sequence; with GQA the gathered K/V are repeated to the
query heads for the flash path (torch 2.13's lower-right dispatch ignores ``enable_gqa``). On
the transformer-engine spec Megatron's TE attention does CP instead (``cp_comm_type``); that
path needs a GPU with TE and has not run here.

Not supported (ValueError): attention bias, sliding windows, non-vanilla softmax, context
parallelism on padded [s, b] batches -- none of which the trainer's CP path uses.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from stapo_megatron.batch.context_parallel import all_gather_sequence, local_positions

try:  # torch >= 2.10 (a prototype there)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
# torch 2.10/2.11 spell causal ``is_causal=True``; later ones a (left, right) window, (-1, 0)
_VARLEN_CAUSAL = ({} if varlen_attn is None else
                  {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters
                  else {"is_causal": True})


class SDPAttention(MegatronModule):
    """``DotProductAttention``'s contract on ``scaled_dot_product_attention`` (see module doc).

    The constructor signature is that of megatron.core.transformer.dot_product_attention
    .DotProductAttention (unchanged from megatron-core 0.16 to 0.19), which is how
    ``SelfAttention`` builds its ``core_attention``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        super().__init__(config=config)
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"SDPAttention does not support sliding-window attention (window_size {config.window_size})")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type 'vanilla' only, got {config.softmax_type!r}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        # context parallelism: this rank holds 2 chunks of every sequence (batch.context_parallel)
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        if self.cp_group is not None and self.cp_group.size() != config.context_parallel_size or (
                config.context_parallel_size > 1 and self.cp_group is None):
            raise ValueError(f"context_parallel_size {config.context_parallel_size} needs a CP group of that size "
                             f"(pg_collection.cp or parallel_state's), got {self.cp_group}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_groups_per_partition = divide(config.num_query_groups, tp_size)
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back inside the fp32 softmax: the product is the plain 1/sqrt(hn).
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention of [sq, b, np, hn] queries over [sk, b, ng, hn] keys/values -> [sq, b, np*hn]."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
                raise ValueError(f"SDPAttention packs qkv_format 'thd' with attention_mask None only, got "
                                 f"{packed_seq_params.qkv_format!r} and a mask: {attention_mask is not None}")
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            raise ValueError(f"SDPAttention with context_parallel_size {self.config.context_parallel_size} needs "
                             f"packed micro-batches (PackedSeqParams qkv_format 'thd'; TrainerConfig.packing "
                             f"'fixed' or 'budget')")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # [s, b, h, d] -> [b, h, s, d]: a strided view; SDPA kernels need only the last dim dense.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            attn_mask = ~attention_mask.bool()  # SDPA: True = attend; Megatron: True = masked out
        elif mask_type == AttnMaskType.causal:
            is_causal = True
        elif mask_type != AttnMaskType.no_mask:
            raise ValueError(f"SDPAttention needs an attention_mask for mask type {mask_type}")
        out = self._sdpa(q, k, v, attn_mask, is_causal)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _sdpa(self, q, k, v, attn_mask, is_causal: bool) -> torch.Tensor:
        """SDPA on [b, h, s, d] with this layer's scale, GQA and dropout."""
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_heads_per_partition != self.num_groups_per_partition
        if isinstance(attn_mask, CausalBias):  # context parallelism's lower-right causal mask
            if not q.is_cuda:  # no flash dispatch on the CPU: an explicit boolean mask keeps enable_gqa
                attn_mask = attn_mask._materialize(q.device)
            elif gqa:  # the flash dispatch ignores enable_gqa (torch 2.13)
                rep = self.num_heads_per_partition // self.num_groups_per_partition
                k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        if dropout_p > 0 and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            # as DotProductAttention: model-parallel-region dropout draws from the TP tracker
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                                      scale=self.softmax_scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                              scale=self.softmax_scale, enable_gqa=gqa)

    def _packed(self, query, key, value, params) -> torch.Tensor:
        """Causal attention within each sequence of a THD row: [t, np, hn] -> [t, np * hn]."""
        cu = params.cu_seqlens_q
        if not torch.equal(cu, params.cu_seqlens_kv):
            raise ValueError("SDPAttention packs self-attention only (cu_seqlens_q == cu_seqlens_kv)")
        if self.cp_group is not None:
            return self._packed_context_parallel(query, key, value, cu)
        dropout_p = self.dropout_p if self.training else 0.0
        if (varlen_attn is not None and query.is_cuda and dropout_p == 0
                and query.dtype in (torch.float16, torch.bfloat16)):
            cu = cu.to(device=query.device, dtype=torch.int32)
            gqa = self.num_heads_per_partition != self.num_groups_per_partition
            if gqa:  # one KV head per group of query heads, as enable_gqa would
                rep = self.num_heads_per_partition // self.num_groups_per_partition
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
            out = varlen_attn(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_kv,
                              scale=self.softmax_scale, **_VARLEN_CAUSAL)
            return out.reshape(out.shape[0], -1)
        # reference path: each sequence alone, [s, h, d] -> [1, h, s, d]
        bounds = cu.tolist()
        outs = [self._sdpa(*(t[a:b].transpose(0, 1)[None] for t in (query, key, value)), None, True)[0]
                for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(query.shape[0], -1)

    def _packed_context_parallel(self, query, key, value, cu_seqlens) -> torch.Tensor:
        """Causal attention of this CP rank's two chunks of every sequence of a THD row
        (``batch.context_parallel``: chunks r and 2 CP - 1 - r, ``cu_seqlens`` global).

        K and V are all-gathered over the CP group (Llama 3's all-gather CP; their gradients
        are summed back over CP and this rank's part kept, a reduce-scatter) and put in global
        order; then `chunk_attention`. Exact: every query sees the keys it sees without CP."""
        cp = dist.get_world_size(self.cp_group)
        # the gathered [CP, t] tokens in global order: position p of the row is gathered[order[p]]
        where = torch.cat([local_positions(cu_seqlens.cpu(), cp, j) for j in range(cp)])
        order = torch.empty_like(where)
        order[where] = torch.arange(where.numel())
        order = order.to(query.device)
        key_all, value_all = (all_gather_sequence(t, self.cp_group).flatten(0, 1).index_select(0, order)
                              for t in (key, value))
        return chunk_attention(self._sdpa, query, key_all, value_all, cu_seqlens, cp, dist.get_rank(self.cp_group))


def chunk_attention(sdpa, query, key_all, value_all, cu_seqlens, cp: int, rank: int) -> torch.Tensor:
    """CP rank ``rank``'s attention: query [t, np, hn] (its chunks, local order), key_all /
    value_all [T, ng, hn] (the whole row, global order) -> [t, np * hn].

    Query chunk k of a sequence (c tokens at global positions k c .. (k + 1) c - 1 of it)
    attends to the sequence's keys [0, (k + 1) c) with a lower-right-aligned causal mask
    (``causal_lower_right``: query i sees keys up to its own global position), which flash
    and memory-efficient kernels take without a materialised mask on CUDA. ``sdpa(q, k, v,
    mask, is_causal)`` is `SDPAttention._sdpa` (scale, GQA, dropout)."""
    bounds = cu_seqlens.tolist()
    outs, local = [], 0
    for start, end in zip(bounds, bounds[1:]):
        c = (end - start) // (2 * cp)
        for k, q0 in ((rank, local), (2 * cp - 1 - rank, local + c)):
            keys = slice(start, start + (k + 1) * c)
            q, kk, vv = (t.transpose(0, 1)[None] for t in (query[q0:q0 + c], key_all[keys], value_all[keys]))
            # chunk 0 sees only itself: plain causal; later chunks: lower-right aligned
            outs.append(sdpa(q, kk, vv, None, True)[0] if k == 0 else
                        sdpa(q, kk, vv, causal_lower_right(c, kk.shape[2]), False)[0])
        local += 2 * c
    return torch.cat(outs, dim=1).transpose(0, 1).reshape(query.shape[0], -1)
