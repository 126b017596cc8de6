"""Tier a: the paper launch files are exactly one per paper recipe."""

import os

import pytest

pytest.importorskip("nemo_run")

from stapo_megatron.launch import arguments  # noqa: E402
from tests.helpers.launch_cli import PAPER_FILES  # noqa: E402


def test_paper_launch_files_are_every_paper_recipes_file():
    assert all(os.path.isfile(os.path.join(os.path.dirname(arguments.LAUNCH_DIR), f)) for f in PAPER_FILES)
    assert arguments.paper_launch_files() == sorted(PAPER_FILES)  # five, not the tiny or doctor files
