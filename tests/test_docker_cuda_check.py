"""Tier a: the Dockerfile's CUDA-major check (scripts/check_cuda_major.py) before transformer-engine
is compiled; the image itself cannot be built here (no GPU, no container registry)."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("check_cuda_major", os.path.join(HERE, "..", "scripts", "check_cuda_major.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

NVCC_12_9 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.9, V12.9.86\n"
NVCC_13_0 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"


def test_toolkit_version_from_nvcc_or_ngc_env():
    assert check.toolkit_cuda_version(NVCC_13_0) == "13.0"
    assert check.toolkit_cuda_version("", "12.9.1.010") == "12.9.1.010"
    with pytest.raises(ValueError, match="no CUDA toolkit found"):
        check.toolkit_cuda_version("")


def test_mismatched_major_fails_with_both_versions():
    # the old base (pytorch:25.06, CUDA 12.9) with vllm 0.33.0's torch 2.14.0 (CUDA 13)
    problem = check.mismatch("13.0", check.toolkit_cuda_version(NVCC_12_9))
    assert "torch is built for CUDA 13.0 but the image's toolkit is CUDA 12.9" in problem
    assert "base image whose CUDA major is 13" in problem
    assert check.mismatch("13.0", check.toolkit_cuda_version(NVCC_13_0)) is None
    assert check.mismatch("13.1", "13.0") is None  # minor versions are compatible
    assert "CPU build" in check.mismatch(None, "13.0")
