"""Convert an HF Qwen folder -> a Megatron torch_dist checkpoint (TP/PP/EP shards).

    python conversion/hf_to_mcore.py --help

The same as `stapo-convert hf-to-mcore ...`: a thin entry over `stapo_megatron.conversion.cli`, where
the code and its documentation live (exit codes included).
"""

import sys

from stapo_megatron.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
