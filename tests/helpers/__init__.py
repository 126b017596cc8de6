"""Helpers of the test suite: gloo process runners, the torchrun scripts that tests launch, and
the folders tests read from."""

import os

HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(HELPERS_DIR)
REPO_DIR = os.path.dirname(TESTS_DIR)
