"""Tier a: the package-wide helpers of `stapo_megatron.utils` (sizes in messages)."""

import pytest

from stapo_megatron.utils import format_bytes


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (64 * 1024, "64.0 KiB"),
    (1_234_567, "1.18 MiB"), (768 * 2**20, "768 MiB"), (12 * 2**30, "12.0 GiB"), (3 * 2**40, "3.00 TiB"),
    (1 << 62, "4.00 EiB"), (1 << 70, "1024 EiB"), (2.5 * 2**30, "2.50 GiB")])
def test_format_bytes_picks_the_unit_by_magnitude(nbytes, text):
    assert format_bytes(nbytes) == text
