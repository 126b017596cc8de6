"""Convert Megatron logits from a checkpoint against transformers logits from the HF folder.

    python conversion/verify.py --help

The same as `stapo-convert verify ...`: a thin entry over `stapo_megatron.conversion.cli`, where
the code and its documentation live (exit codes included).
"""

import sys

from stapo_megatron.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
