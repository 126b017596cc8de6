"""Tier a: the batch layout's alignments (``batch/alignment.py``): the packing modes, the
multiples a sequence and a row are padded to, a context-parallel rank's tokens."""

import pytest

from stapo_megatron.batch import alignment


@pytest.mark.parametrize("cp, tp, sp, seq, row, tokens", [
    (1, 4, True, 1, 8, 16385),      # no CP: no padding of a sequence; rows: 8 (x TP = 4 under SP: lcm 8)
    (2, 4, True, 16, 16, 8192),     # 2 x CP chunks x TP (SP): 16384 -> 8192 per rank
    (4, 1, False, 8, 8, 4098),      # 16385 -> 8 chunks of 2049 (2 per rank)
    (3, 2, True, 12, 24, 5464),     # 16385 -> 16392 (a multiple of 12), over 3
])
def test_alignments_and_rank_tokens(cp, tp, sp, seq, row, tokens):
    assert alignment.sequence_multiple(cp, tp, sp) == seq
    assert alignment.row_multiple(cp, tp, sp) == row
    length = 16384 if cp == 2 else 16385
    assert alignment.rank_tokens(length, cp, tp, sp) == tokens
