"""The alignments of the batch layout: the packing modes, the multiple a sequence and a row are
padded to, and the tokens one context-parallel rank holds.

The micro-batch builder (`batch.minibatches`), packing (`batch.packing`) and the CP split
(`batch.context_parallel`) lay batches out by them; the layout validator
(`stapo_megatron.config.parallel_layout`) and the memory model (`recipes.memory`) check and
count against them. Imports no torch, so the config tree can ask it.
"""

from __future__ import annotations

import math

PACKING_MODES = ("padded", "fixed", "budget")
"""How a mini-batch becomes micro-batches (`TrainerConfig.packing`): "padded": [N, S] rows of
``micro_batch_size``; "fixed" the same sequences per micro-batch, packed; "budget" packed to a
token budget."""
ROW_MULTIPLE = 8
"""A padded batch's length, or a packed row's, is a multiple of this (tensor-core friendly)."""


def sequence_multiple(context_parallel_size: int, tensor_parallel_size: int = 1,
                      sequence_parallel: bool = False) -> int:
    """What every sequence's length is padded to a multiple of: 2 x CP chunks, each rank's part
    further split over TP by sequence parallelism (1 without CP: no padding)."""
    if context_parallel_size == 1:
        return 1
    return 2 * context_parallel_size * (tensor_parallel_size if sequence_parallel else 1)


def row_multiple(context_parallel_size: int, tensor_parallel_size: int = 1, sequence_parallel: bool = False) -> int:
    """A padded batch's length, or a packed row's, is a multiple of this: `ROW_MULTIPLE`, times TP
    under sequence parallelism (it splits the sequence over TP), and whole CP chunks."""
    return math.lcm(ROW_MULTIPLE, tensor_parallel_size if sequence_parallel else 1,
                    sequence_multiple(context_parallel_size, tensor_parallel_size, sequence_parallel))


def rank_tokens(seq_len: int, context_parallel_size: int, tensor_parallel_size: int = 1,
                sequence_parallel: bool = False) -> int:
    """Tokens one CP rank holds of a ``seq_len``-token sequence: the sequence padded to a
    multiple of `sequence_multiple`, over CP (``seq_len`` at CP = 1)."""
    multiple = sequence_multiple(context_parallel_size, tensor_parallel_size, sequence_parallel)
    return -(-seq_len // multiple) * multiple // context_parallel_size
