"""Fail a container build when the installed torch and the image's CUDA toolkit differ in CUDA major.

transformer-engine's torch extension is compiled with the image's ``nvcc`` against the installed
torch; a torch built for CUDA 13 (``libcudart.so.13``, what vllm 0.33.0's torch 2.14.0 is) next to a
CUDA 12 toolkit builds an extension that fails to load, or links the wrong runtime. Run by the
``Dockerfile`` before transformer-engine is built:

    python scripts/check_cuda_major.py          # exit 1 with the reason on a mismatch
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Optional


def toolkit_cuda_version(nvcc_output: str, cuda_version_env: Optional[str] = None) -> str:
    """The image's CUDA version: ``nvcc --version``'s "release X.Y", else NGC's ``CUDA_VERSION``."""
    match = re.search(r"release (\d+)\.(\d+)", nvcc_output)
    if match:
        return f"{match.group(1)}.{match.group(2)}"
    if cuda_version_env:
        return cuda_version_env
    raise ValueError("no CUDA toolkit found: neither `nvcc --version` nor CUDA_VERSION gives a version")


def mismatch(torch_cuda: Optional[str], toolkit: str) -> Optional[str]:
    """Why torch (``torch.version.cuda``) and the toolkit cannot build extensions together, or None."""
    if torch_cuda is None:
        return "the installed torch is a CPU build (torch.version.cuda is None); install a CUDA torch first"
    if torch_cuda.split(".")[0] != toolkit.split(".")[0]:
        return (f"torch is built for CUDA {torch_cuda} but the image's toolkit is CUDA {toolkit}: their major "
                f"versions differ, so transformer-engine would be compiled against the wrong CUDA runtime. "
                f"Use a base image whose CUDA major is {torch_cuda.split('.')[0]} (BASE_IMAGE), or pin a torch "
                f"built for CUDA {toolkit.split('.')[0]}.")
    return None


def main() -> int:
    import torch

    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        nvcc = ""
    toolkit = toolkit_cuda_version(nvcc, os.environ.get("CUDA_VERSION"))
    problem = mismatch(torch.version.cuda, toolkit)
    if problem:
        print(f"check_cuda_major: {problem}", file=sys.stderr)
        return 1
    print(f"check_cuda_major: torch {torch.__version__} (CUDA {torch.version.cuda}) matches the toolkit (CUDA {toolkit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
