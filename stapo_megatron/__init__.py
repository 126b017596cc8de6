"""stapo-megatron: STAPO (Spurious-Token-Aware Policy Optimization, arXiv 2602.15620) on Megatron-Core.

Importing the package is cheap and needs no GPU: heavy optional dependencies (vllm,
nemo_run, transformer_engine) are imported where they are used.
"""

__version__ = "0.1.0"
