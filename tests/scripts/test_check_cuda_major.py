"""Tier a: the Dockerfile's CUDA-major check (scripts/check_cuda_major.py) before transformer-engine
is compiled; the image itself cannot be built here (no GPU, no container registry)."""

import importlib.util
import os

import pytest
from tests.helpers import TESTS_DIR

HERE = TESTS_DIR
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


def _dockerfile() -> str:
    with open(os.path.join(HERE, "..", "Dockerfile"), encoding="utf-8") as f:
        return f.read()


def test_ngc_pip_constraints_are_lifted_before_vllm_replaces_torch():
    """NGC PyTorch >= 25.03 pins its packages in /etc/pip/constraint.txt: the file is emptied (kept
    as constraint.ngc.txt) and PIP_CONSTRAINT cleared before `pip install vllm`."""
    text = _dockerfile()
    empty = text.index(": > /etc/pip/constraint.txt")
    assert text.index("cp /etc/pip/constraint.txt /etc/pip/constraint.ngc.txt") < empty
    assert empty < text.index("ENV PIP_CONSTRAINT=\n") < text.index('pip install "vllm==0.33.0"')
    assert text.startswith("# syntax=docker/dockerfile:1")  # the final check is a heredoc


def test_image_check_names_the_package_that_failed(tmp_path):
    """The build's last step, run here: it passes on this venv and names a package whose import
    raises (an OSError, as an extension built against another torch raises), with the error."""
    import subprocess
    import sys

    script = _dockerfile().split("RUN python - <<'PY'\n")[1].split("\nPY")[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")])}
    ok = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "image check: torch" in ok.stdout and "image check: stapo_megatron.trainer.loop" in ok.stdout
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise OSError('libcudart.so.12: cannot open shared object file')\n")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    bad = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 1
    assert "image check: `import vllm` failed: OSError: libcudart.so.12: cannot open shared object file" in bad.stderr
