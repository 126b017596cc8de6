"""Training checkpoints: Megatron dist_checkpointing of model + optimizer, plus trainer state.

Layout under ``<run_dir>/checkpoints``:

    step_00000010/          a complete checkpoint (torch_dist format, loads at any TP/PP)
        .metadata, *.distcp    model ("model." keys, the same keys `stapo-convert` writes) and
                               optimizer state ("optimizer." keys)
        trainer_state.pt       step, LR-scheduler state, data position, anything the trainer adds
        rng_rank00000.pt ...   per-rank RNG states (python, numpy, torch, Megatron's tracker)
        config.yaml, provenance.json, hf/   what produced it (`stapo_megatron.runlog.provenance`,
                               written by the trainer through ``write_extra``)
    latest                     text file naming the newest complete checkpoint; written last

A checkpoint is written to ``.tmp_step_...`` and renamed when every rank has finished; the
``latest`` marker is replaced atomically afterwards. A run killed at any point therefore leaves
either the previous complete checkpoint or the new one, never a half-written directory that looks
complete; ``find_latest`` additionally checks the files a complete checkpoint has.

LoRA runs (`stapo_megatron.mcore.lora`) save only the adapters of the model (keys ``...lora.A`` /
``...lora.B``) and their optimizer state: the frozen base is what the run builds again from its
configuration (``model.megatron_ckpt`` or the seeded initialisation), so a resume is exact at a
fraction of the full checkpoint's size. Resuming a full checkpoint as LoRA, or the reverse, is
refused naming ``lora``.

Retention (``keep_last``, `prune_checkpoints`): after a save is published, the oldest
``step_*`` directories beyond the newest ``keep_last`` complete ones are deleted; the one
``latest`` names and the newest complete one are never deleted.
"""

from __future__ import annotations

import importlib
import os
import pickle
import random
import shutil
import signal
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from stapo_megatron.mcore.checkpoint_optimizer import (optimizer_sharded_state_dict, restore_loaded_optimizer_state,
                                                       unshare_adam_steps)
from stapo_megatron.mcore.lora import lora_adapters
from stapo_megatron.mcore.mcore_versions import checkpoint_writer_queue

LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"

# What a DCP `.metadata` pickle may name (torch 2.1 - 2.13): DCP's own classes, and a few torch
# and standard-library values. DCP itself reads it with plain pickle.load, which runs whatever
# a crafted file names (os.system, ...); here anything else is refused.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                    ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = None
        if module in _DCP_MODULES and "." not in name:
            candidate = getattr(importlib.import_module(module), name, None)
            # a class DCP defines there (dataclasses and enums), never a function or a module
            if isinstance(candidate, type) and candidate.__module__ == module:
                obj = candidate
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        elif (module, name) in _ALLOWED_GLOBALS:
            obj = super().find_class(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of a checkpoint's metadata)")
        return obj


def read_dcp_metadata(path: str):
    """DCP's `Metadata` of the checkpoint directory ``path``, unpickled without running code.

    Raises:
        ValueError: the file is missing, truncated, or names anything but DCP metadata classes.
    """
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # truncated or crafted: unpickling fails in many ways
        raise ValueError(f"{path}: cannot read the checkpoint's .metadata ({type(e).__name__}: {e})") from None
    if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    return metadata


def _numpy_pickle_globals() -> list:
    """What a pickled numpy array names (np.random.get_state() holds one), whichever numpy."""
    reconstruct = np.zeros(1).__reduce__()[0]
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _torch_load_weights_only(path: str) -> Any:
    """torch.load without executing code: tensors, containers, numbers and numpy arrays only."""
    try:
        with torch.serialization.safe_globals(_numpy_pickle_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refused to load ({str(e).splitlines()[0]})") from None


def read_trainer_state(path: str) -> Dict[str, Any]:
    """The trainer state (step, data position, ...) of the checkpoint directory ``path``."""
    return _torch_load_weights_only(os.path.join(path, TRAINER_STATE))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


LORA_KEY = ".lora."
"""What every key of a LoRA adapter's parameters holds (``<linear>.lora.A``, ``<linear>.lora.B``)."""
NOT_MODEL_KEYS = ("optimizer.", "common_state/")
"""Stored keys that are not the model's: its optimizer state, and megatron-core 0.19's common
state saved as a sharded object (``common_state/shard_0_1``; 0.16 keeps it in a file)."""


def saved_model_keys(stored) -> list:
    """The model's keys among a checkpoint's stored ones (`NOT_MODEL_KEYS` aside)."""
    return [k for k in stored if not k.startswith(NOT_MODEL_KEYS)]


def _sharded(model, optimizer, is_loading: bool) -> Dict[str, Any]:
    model_sd = model.sharded_state_dict()
    if lora_adapters(model):  # adapter-only: the frozen base comes from the run's configuration
        model_sd = {k: v for k, v in model_sd.items() if LORA_KEY in k}
    return {"model": model_sd, "optimizer": optimizer_sharded_state_dict(optimizer, model_sd, is_loading)}


WARNING_SIGNALS = (signal.SIGUSR1,)
"""Slurm's warning before the time limit (`stapo_megatron.trainer.preemption.DEFAULT_SIGNALS`)."""


def _start_writer_ignoring_warning() -> None:
    """Start megatron-core's checkpoint-writer queue, a Manager process it spawns at the first
    save and keeps, with the warning signal ignored (an ignored signal stays ignored across the
    spawn). Slurm signals every process of the job step and torchrun forwards the signal to its
    workers' process groups; the Manager's default action would end it, and the save the
    signal asks for would then fail in ``dist_checkpointing.save`` (a broken pipe). Only from
    the main thread, where handlers can be set (the trainer saves there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in WARNING_SIGNALS}
    try:
        checkpoint_writer_queue()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def save_checkpoint(run_dir: str, step: int, model, optimizer, trainer_state: Dict[str, Any],
                    write_extra: Optional[Callable[[str], None]] = None, keep_last: int = 0) -> str:
    """Collective: save model, optimizer, RNG and ``trainer_state`` as step ``step``; publish it.

    Args:
        write_extra: called on rank 0 with the (unpublished) checkpoint directory, to add files
            (the run's provenance) before it is published.
        keep_last: keep this many newest complete checkpoints (`prune_checkpoints`); 0 = all.
    Returns the published directory.
    """
    from megatron.core import dist_checkpointing

    root = os.path.join(run_dir, "checkpoints")
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, f".tmp_{name}"), os.path.join(root, name)
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a run killed while saving
        os.makedirs(tmp)
    _barrier()
    _start_writer_ignoring_warning()
    dist_checkpointing.save(_sharded(model, optimizer, is_loading=False), tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{_rank():05d}.pt"))
    if _rank() == 0:
        torch.save(dict(trainer_state, step=step), os.path.join(tmp, TRAINER_STATE))
        if write_extra is not None:
            write_extra(tmp)
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):  # re-saving the same step after a resume
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = os.path.join(root, f".{LATEST}.tmp")
        with open(marker_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_tmp, os.path.join(root, LATEST))
        if keep_last:
            prune_checkpoints(run_dir, keep_last, world_size=dist.get_world_size() if dist.is_initialized() else 1)
    _barrier()
    return final


def prune_checkpoints(run_dir: str, keep_last: int, world_size: int = 1) -> List[str]:
    """Delete the ``step_*`` directories of a run older than its newest ``keep_last`` complete
    ones; returns the deleted paths (oldest first).

    Never deleted: the checkpoint ``latest`` names, and the newest complete checkpoint (both
    are what a resume loads). Incomplete directories newer than the oldest kept one are left
    alone (a save may be in progress); older ones go with the checkpoints around them.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = os.path.join(run_dir, "checkpoints")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    complete = [d for d in steps if _is_complete(os.path.join(root, d), world_size)]
    kept = set(complete[-keep_last:])
    marker = os.path.join(root, LATEST)
    if os.path.exists(marker):
        with open(marker) as f:
            kept.add(f.read().strip())
    if not kept:
        return []
    oldest_kept = min(kept)
    deleted = []
    for name in steps:
        if name not in kept and name < oldest_kept:
            shutil.rmtree(os.path.join(root, name))
            deleted.append(os.path.join(root, name))
    return deleted


def save_model_only(model, path: str) -> str:
    """Collective: save the model weights alone (no optimizer, RNG or trainer state) to ``path``.

    The result loads with ``stapo_megatron.bridge.model.load_checkpoint`` (``ModelConfig.megatron_ckpt``)
    at any TP/PP; the method comparison uses it to share one warm-start between runs. Written to
    a temporary sibling and renamed when every rank has finished.
    """
    from megatron.core import dist_checkpointing

    path = path.rstrip("/")
    tmp = os.path.join(os.path.dirname(path) or ".", f".tmp_{os.path.basename(path)}")
    if os.path.exists(path):  # checked on every rank (before any collective), so none is left waiting
        raise FileExistsError(f"{path} exists; not overwriting a saved model")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    inner = model.module if hasattr(model, "module") else model
    _start_writer_ignoring_warning()  # the first save of a run may be this one (the warm-start's)
    dist_checkpointing.save(inner.sharded_state_dict(), tmp)
    _barrier()
    if _rank() == 0:
        os.replace(tmp, path)
    _barrier()
    return path


def _is_complete(path: str, world_size: int) -> bool:
    files = set(os.listdir(path)) if os.path.isdir(path) else set()
    ranks_ok = all(f"rng_rank{r:05d}.pt" in files for r in range(world_size))
    return ".metadata" in files and TRAINER_STATE in files and ranks_ok


def find_latest(run_dir: str, world_size: Optional[int] = None) -> Optional[str]:
    """The newest complete checkpoint of a run, or None.

    Follows the ``latest`` marker; if it is missing or names an incomplete directory, falls back
    to the newest complete ``step_*`` directory (a marker is written after its directory).
    """
    world_size = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    marker = os.path.join(root, LATEST)
    if os.path.exists(marker):
        with open(marker) as f:
            path = os.path.join(root, f.read().strip())
        if _is_complete(path, world_size):
            return path
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for name in reversed(steps):
        if _is_complete(os.path.join(root, name), world_size):
            return os.path.join(root, name)
    return None


def _check_optimizer_layout(path: str, stored, optimizer_sharded) -> None:
    """ValueError if the optimizer state was saved as one optimizer and is loaded into a chained
    one (keys ``chained_<i>.``), or the reverse. megatron-core chains a second optimizer for the
    expert parameters of a MoE model when expert parallelism splits them off (EP > 1), so a
    checkpoint saved at EP=2 does not load its optimizer state at EP=1 (the model weights do:
    `stapo_megatron.bridge.load_checkpoint` warm-starts from them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved_chained = any(k.startswith("chained_") for k in stored)
    keys = [getattr(v, "key", "") for v in nested_values(optimizer_sharded)]
    want_chained = any(k.startswith("chained_") for k in keys)
    if keys and saved_chained != want_chained:
        how = ("a chained optimizer (expert parameters apart: expert_model_parallel_size > 1)", "a single optimizer")
        raise ValueError(
            f"checkpoint {path} holds the optimizer state of {how[0] if saved_chained else how[1]}, but this run "
            f"builds {how[0] if want_chained else how[1]}: resume with the expert_model_parallel_size the checkpoint "
            "was saved with, or start a new run from its model weights (stapo_megatron.bridge.load_checkpoint)")


def _check_lora_layout(path: str, stored, lora: bool) -> None:
    """ValueError naming ``lora`` if the checkpoint is adapter-only and the run is not, or the
    reverse (the saved model keys, optimizer state aside, show which)."""
    model_keys = saved_model_keys(stored)
    saved_lora = bool(model_keys) and all(LORA_KEY in k for k in model_keys)
    if saved_lora and not lora:
        raise ValueError(f"checkpoint {path} holds LoRA adapters only (a run with the lora section), but this run "
                         f"has lora=None (full fine-tuning): resume it with the lora section it was saved with")
    if lora and not saved_lora:
        raise ValueError(f"checkpoint {path} holds a full model (a run without the lora section), but this run has "
                         f"lora set: resume it with lora=none, or start a new LoRA run from its weights "
                         f"(model.megatron_ckpt={path})")


def load_checkpoint(path: str, model, optimizer) -> Dict[str, Any]:
    """Collective: restore model, optimizer and this rank's RNG; return the trainer state."""
    from megatron.core import dist_checkpointing

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if not _is_complete(path, world_size):
        raise ValueError(
            f"{path} is not a complete checkpoint for {world_size} ranks (needs .metadata, "
            f"{TRAINER_STATE} and rng_rank*.pt for every rank)"
        )
    # Every small file is read first, without executing code: megatron-core's loader unpickles
    # `.metadata` with plain pickle (DCP's FileSystemReader, torch 2.13), so a crafted one is
    # refused here before it runs.
    stored = read_dcp_metadata(path).state_dict_metadata
    rng_state = _torch_load_weights_only(os.path.join(path, f"rng_rank{_rank():05d}.pt"))
    trainer_state = read_trainer_state(path)
    lora = bool(lora_adapters(model))
    _check_lora_layout(path, stored, lora)
    sharded = _sharded(model, optimizer, is_loading=True)
    _check_optimizer_layout(path, stored, sharded["optimizer"])
    state = dist_checkpointing.load(sharded, path)
    # Megatron DDP's load_state_dict returns nothing: load into the wrapped module, whose keys
    # lack DDP's "module." prefix, to see what is missing.
    inner, prefix = (model.module, "module.") if hasattr(model, "module") else (model, "")
    model_state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state["model"].items()}
    missing, unexpected = inner.load_state_dict(model_state, strict=False)
    # TE fp8 metadata only; with LoRA the frozen base, which the checkpoint does not hold
    missing = [k for k in missing if not k.endswith("_extra_state") and (not lora or LORA_KEY in k)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    restore_loaded_optimizer_state(state["optimizer"])
    # The distributed optimizer copies the loaded master weights into its shards in place; with
    # fp32 training those are views of the model's parameters, which autograd refuses outside
    # no_grad (megatron-core 0.16 - 0.19, distrib_optimizer._set_main_param_and_optimizer_states).
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
    unshare_adam_steps(optimizer)
    _set_rng_state(rng_state)
    return trainer_state
