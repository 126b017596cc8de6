"""Convert a Megatron torch_dist checkpoint -> an HF Qwen folder.

    python conversion/mcore_to_hf.py --help

The same as `stapo-convert mcore-to-hf ...`: a thin entry over `stapo_megatron.conversion.cli`, where
the code and its documentation live (exit codes included).
"""

import sys

from stapo_megatron.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["mcore-to-hf", *sys.argv[1:]]))
