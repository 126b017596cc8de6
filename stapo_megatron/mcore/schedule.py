"""The one micro-batch runner on Megatron-Core's schedules, used by the RL update, the pi_old and
reference passes and the SFT warm-start.

``run_microbatches`` drives ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved,
whatever ``parallel_state`` set up) over a list of `MicroBatch` objects; the caller gives a
``make_loss(batch)`` that returns Megatron's ``loss_func`` for one micro-batch (the STAPO loss of
``stapo_megatron.mcore.loss``, the NLL of ``stapo_megatron.mcore.sft``, or the no-grad statistics
of ``compute_logprob_entropy``: the pi_old pass and the "exact" tau_H pre-pass). A `PassContext`
carries what every pass needs besides the micro-batches.

Packed micro-batches (``MicroBatch.cu_seqlens``, ``stapo_megatron.batch.packing``) reach the
model with Megatron's ``PackedSeqParams(qkv_format="thd")``: RoPE restarts per sequence and the
core attention (TE's, or the local spec's `SDPAttention`) keeps sequences apart. Their lengths
differ between micro-batches; without pipelining no schedule reads ``seq_length``; with it the
p2p buffers would need Megatron's ``variable_seq_lengths``, not wired here (ValueError).

Router replay (``replay_routes``, mixture-of-experts policies): each micro-batch's
``MicroBatch.routes`` become its routers' targets before its forward and their FIFO for a
recomputation in backward, cleared after the pass (`stapo_megatron.mcore.router_replay`).

Legend: [B, S] = micro-batch x sequence, aligned with the labels ([1, T] packed).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from stapo_megatron.mcore.parallel import Groups
from stapo_megatron.mcore.router_replay import clear_replay, replay_backward, set_replay_targets


def packed_seq_params(batch: MicroBatch):
    """Megatron's ``PackedSeqParams(qkv_format="thd")`` of a packed micro-batch; None if padded."""
    if not batch.is_packed:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    # Context parallelism: the tensors are this rank's chunks, cu_seqlens / max_seqlen the whole
    # row's (Megatron's RoPE picks each sequence's chunks of the global positions from them).
    # The sequences are already padded to 2 x CP chunks, so the "padded" offsets TE's CP
    # attention reads are the same ones.
    padded = batch.cu_seqlens if batch.cp_size > 1 else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.cu_seqlens, cu_seqlens_kv=batch.cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass of a model over micro-batches needs besides them."""

    model: Any
    """The Megatron GPTModel (DDP-wrapped for updates; any pipeline stage)."""
    seq_length: int
    """The padded sequence length S of every micro-batch (packed: the longest row T; unused
    without pipelining)."""
    temperature: float = 1.0
    """Logits are divided by it, as the sampler did (`LossConfig.temperature`)."""
    groups: Optional[Groups] = None
    """This rank's process groups; None: one process (no TP, the last stage)."""
    vocab_size: Optional[int] = None
    """The real vocabulary if the output layer is padded (see ops); None: the layer's width."""
    replay_routes: bool = False
    """Router replay: the model's MoE routers take each micro-batch's ``routes`` (the policy's
    passes with ``rollout.routing_replay``; never the frozen reference: `mcore.reference`)."""

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.groups.tp if self.groups is not None else None

    @property
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """The context-parallel group (None: no CP group), for losses with per-sequence statistics."""
        return self.groups.cp if self.groups is not None else None

    @property
    def is_last_stage(self) -> bool:
        return self.groups.is_last_stage if self.groups is not None else True


def forward_step_func(make_loss: Callable, replay_routes: bool = False) -> Callable:
    """A forward_step_func running the GPTModel on a `MicroBatch`; ``make_loss(batch)`` gives
    the loss function Megatron applies to the last stage's output. ``replay_routes``: the
    routers replay the micro-batch's routes (module docstring)."""

    def forward_step(data_iterator, model):
        # Micro-batches may be built on the CPU (tests, library users); the model's device is
        # where they are used. A no-op for tensors already there (the trainer's).
        batch = next(data_iterator).to(next(model.parameters()).device, non_blocking=True)
        if replay_routes:
            set_replay_targets(model, batch)
        output = model(batch.tokens, batch.position_ids, attention_mask=None,
                       packed_seq_params=packed_seq_params(batch))
        if replay_routes:  # from here on a router runs only to recompute: this micro-batch's FIFO entry
            replay_backward(model)
        return output, make_loss(batch)

    return forward_step


def run_microbatches(model, microbatches: List[MicroBatch], seq_length: int,
                     make_loss: Callable, forward_only: bool = False, replay_routes: bool = False) -> list:
    """Megatron's ``forward_backward_func`` over micro-batches (any PP schedule); with
    ``replay_routes`` the MoE routers replay the micro-batches' routes.

    Returns the loss functions' metric dicts, one per micro-batch, on the last pipeline stage.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if any(mb.is_packed for mb in microbatches):
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if pp > 1:
            raise ValueError(f"packed micro-batches (packing != 'padded') are not supported with pipeline "
                             f"parallelism yet (pipeline_model_parallel_size {pp}); use packing='padded'")
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step_func(make_loss, replay_routes),
            data_iterator=iter(microbatches),
            model=model,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=microbatches[0].num_rows,
            forward_only=forward_only,
        )
    finally:
        if replay_routes:  # nothing carries over to the next pass (or a model used without replay)
            clear_replay(model)


def _stats_loss_func(temperature, tp_group, vocab_size, batch: MicroBatch, logits):
    logprob, entropy = vocab_parallel_logprob_entropy(
        logits, batch.labels, tp_group=tp_group, temperature=temperature, vocab_size=vocab_size
    )
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, torch.zeros((), dtype=torch.int, device=logits.device), {"logprob": logprob, "entropy": entropy}


def compute_logprob_entropy(ctx: PassContext, microbatches: List[MicroBatch]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """No-grad forward over micro-batches: per micro-batch (logprob, entropy), each [B, S].

    The pi_old pass of a step, the reference pass and the "exact" tau_H pre-pass. Results exist
    on the last pipeline stage; other stages get an empty list.
    """
    with torch.no_grad():
        outputs = run_microbatches(
            ctx.model, microbatches, ctx.seq_length,
            lambda batch: partial(_stats_loss_func, ctx.temperature, ctx.tp_group, ctx.vocab_size, batch),
            forward_only=True, replay_routes=ctx.replay_routes,
        )
    return [(out["logprob"], out["entropy"]) for out in outputs]


def old_policy_pass(ctx: PassContext, minis: List[List[MicroBatch]]) -> None:
    """pi_old's log-probs and entropies (no grad) into every micro-batch of every mini-batch:
    ``old_logprob`` and ``old_entropy`` (zeros on the other pipeline stages, where no loss
    reads them)."""
    for mini in minis:
        stats = compute_logprob_entropy(ctx, mini)
        for i, mb in enumerate(mini):
            if ctx.is_last_stage:
                mb.old_logprob, mb.old_entropy = stats[i]
            else:
                mb.old_logprob = torch.zeros_like(mb.advantages)
                mb.old_entropy = torch.zeros_like(mb.advantages)
