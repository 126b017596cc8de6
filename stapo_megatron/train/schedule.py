"""The one micro-batch runner on Megatron-Core's schedules, used by the RL update and the SFT warm-start.

``run_microbatches`` drives ``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved,
whatever ``parallel_state`` set up) over a list of micro-batch dicts; the caller gives a
``make_loss(batch)`` that returns Megatron's ``loss_func`` for one micro-batch (the STAPO loss of
``stapo_megatron.train.loss``, the NLL of ``stapo_megatron.train.sft``, or the no-grad statistics of
``compute_logprob_entropy``: the pi_old pass and the "exact" tau_H pre-pass).

Legend: [B, S] = micro-batch x sequence, aligned with the labels.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.train.ops import vocab_parallel_logprob_entropy


def forward_step_func(make_loss: Callable) -> Callable:
    """A forward_step_func running the GPTModel on a micro-batch dict; ``make_loss(batch)`` gives
    the loss function Megatron applies to the last stage's output."""

    def forward_step(data_iterator, model):
        # Micro-batches may be built on the CPU (tests, library users); the model's device is
        # where they are used. A no-op for tensors already there (the trainer's).
        device = next(model.parameters()).device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], attention_mask=None)
        return output, make_loss(batch)

    return forward_step


def run_microbatches(model, microbatches: List[Dict[str, torch.Tensor]], seq_length: int,
                     make_loss: Callable, forward_only: bool = False) -> list:
    """Megatron's ``forward_backward_func`` over micro-batch dicts (any PP schedule).

    Returns the loss functions' metric dicts, one per micro-batch, on the last pipeline stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func(make_loss),
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def _stats_loss_func(temperature, tp_group, vocab_size, batch, logits):
    logprob, entropy = vocab_parallel_logprob_entropy(
        logits, batch["labels"], tp_group=tp_group, temperature=temperature, vocab_size=vocab_size
    )
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, torch.zeros((), dtype=torch.int, device=logits.device), {"logprob": logprob, "entropy": entropy}


def compute_logprob_entropy(
    model,
    microbatches: List[Dict[str, torch.Tensor]],
    seq_length: int,
    temperature: float = 1.0,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """No-grad forward over micro-batches: per micro-batch (logprob, entropy), each [B, S].

    The pi_old pass of a step and the "exact" tau_H pre-pass. Results exist on the last
    pipeline stage; other stages get an empty list.
    """
    with torch.no_grad():
        outputs = run_microbatches(
            model, microbatches, seq_length,
            lambda batch: partial(_stats_loss_func, temperature, tp_group, vocab_size, batch),
            forward_only=True,
        )
    return [(out["logprob"], out["entropy"]) for out in outputs]
