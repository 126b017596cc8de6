"""What a submission of a recipe would have wrong, found on the login node before anything is
queued; `nemo-run` (`stapo_megatron.launch.cli`) refuses a submission with any of them and lists
them all in a dry run.

Checked on the final configuration (recipe + ``config=`` + overrides; the recipe's own checks,
such as the paths it leaves to the user, run in `entry.build_config`): the output folder (absolute on Slurm, set, mounted into the
container), every path the job reads (it exists, seen through the container mounts, and a mount
holds it: `stapo_megatron.launch.paths`), and the model folder against the recipe
(`model_problems`: a dense ``Qwen3ForCausalLM`` folder given to the MoE recipe, or an 8B-shaped
folder to the 14B recipe, would fail or train the wrong model only after the GPUs are allocated;
a prompt plus response longer than the folder's ``max_position_embeddings`` would fail only when
vLLM starts). Every check runs whatever the others found, so that one pass lists every problem.
"""

import json
import os
from typing import List, Optional

import nemo_run as run

from stapo_megatron.launch import entry, paths

OUTPUT_DIR_PLACEHOLDER = "<unset:output_dir>"
"""The run folder of a paper recipe on Slurm until ``output_dir=/shared/path`` is given (a dry run
shows it in the job; a submission is refused)."""


def mounts_of(executor) -> List[str]:
    """The container mounts of a Slurm executor in a container; [] otherwise."""
    if not isinstance(executor, run.SlurmExecutor) or not executor.container_image:
        return []
    return list(executor.container_mounts or [])


def host_run_dir(cfg, executor) -> str:
    """The run folder as the batch host (outside the container) sees it."""
    return paths.host_path(cfg.run_dir, mounts_of(executor))


def output_dir_problems(cfg, executor) -> List[str]:
    """A Slurm run needs its output folder set and absolute."""
    if not isinstance(executor, run.SlurmExecutor):
        return []
    if cfg.run_dir == OUTPUT_DIR_PLACEHOLDER:
        return ["output_dir is not set: give an absolute path on a shared file system (output_dir=/shared/path/run)"]
    if not os.path.isabs(cfg.run_dir):
        return [f"output_dir {cfg.run_dir!r} is relative: a Slurm job needs an absolute path on a shared "
                "file system (set output_dir=/shared/path/run; each node and each requeued job resolve "
                "a relative one against their own working directory)"]
    return []


def job_problems(cfg, recipe: str, config_file: Optional[str], executor) -> List[str]:
    """Every problem of the output folder, the paths read and the model folder of a job of ``cfg``
    on ``executor``; the tiny recipes' model folder is written by the job, not read."""
    slurm = isinstance(executor, run.SlurmExecutor)
    mounts = mounts_of(executor)
    read = [(setting, path) for setting, path in paths.paths_read(cfg, config_file)
            if not (recipe in entry.TINY and setting == "model.hf_dir")]
    problems = output_dir_problems(cfg, executor)
    problems += paths.path_problems(read, dict(getattr(executor, "env_vars", None) or {}), mounts,
                                    needs_absolute=slurm)
    if slurm and executor.container_image:
        output_dir = None if cfg.run_dir == OUTPUT_DIR_PLACEHOLDER else cfg.run_dir
        problems += paths.mount_problems(read, output_dir, mounts)
    if recipe not in entry.TINY and cfg.model.hf_dir:
        seen = paths.host_path(cfg.model.hf_dir, mounts) if os.path.isabs(cfg.model.hf_dir) else cfg.model.hf_dir
        problems += model_problems(recipe, cfg, seen)
    return problems


COMPARED = (("architecture", "architectures"), ("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
            ("num_attention_heads", "num_attention_heads"), ("num_query_groups", "num_key_value_heads"),
            ("num_moe_experts", "num_experts"))
"""(`QwenSpec` field, HF config.json key) pairs compared with the recipe's architecture."""


def _folder_value(hf: dict, key: str):
    if key == "architectures":
        return (hf.get(key) or [None])[0]
    return hf.get(key)


def architecture_problems(recipe: str, hf: dict, where: str) -> List[str]:
    """The differences between ``hf`` (a config.json) and the architecture of ``recipe``."""
    from stapo_megatron.recipes.lora import recipe_module

    recipes = recipe_module(recipe)
    spec, display_name = recipes.ARCHITECTURES[recipe], recipes.DISPLAY_NAMES[recipe]
    problems = []
    for field, key in COMPARED:
        want, have = getattr(spec, field), _folder_value(hf, key)
        if field == "num_moe_experts" and not want and not have:
            continue  # dense both
        if want != have:
            problems.append(f"model.hf_dir {where} has {key}={have!r}, but recipe {recipe} trains "
                            f"{display_name} ({key}={want!r})")
    return problems


def length_problems(cfg, hf: dict, where: str) -> List[str]:
    """Training and evaluation sequences longer than the folder's ``max_position_embeddings``."""
    from stapo_megatron.eval.evaluator import eval_max_len

    limit = hf.get("max_position_embeddings")
    if not isinstance(limit, int):
        return []
    problems = []
    prompt = cfg.data.max_prompt_len
    for what, response in (("rollout.max_response_len", cfg.rollout.max_response_len),
                           ("the evaluation's response limit", eval_max_len(cfg.eval, cfg.rollout.max_response_len))):
        if prompt + response > limit:
            problems.append(f"data.max_prompt_len + {what} = {prompt} + {response} = {prompt + response} tokens "
                            f"exceed max_position_embeddings={limit} of model.hf_dir {where}")
    return problems


def model_problems(recipe: str, cfg, folder: str) -> List[str]:
    """Everything wrong with ``folder`` (``cfg.model.hf_dir`` as this machine sees it) for a run of
    ``cfg`` with the paper recipe ``recipe``; nothing when the folder is missing (the path check
    names that)."""
    if not os.path.isdir(folder):
        return []
    where = repr(cfg.model.hf_dir)
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        return [f"model.hf_dir {where} has no config.json: give the folder of a Hugging Face checkpoint"]
    except (OSError, ValueError) as e:
        return [f"model.hf_dir {where}: cannot read {path}: {e}"]
    return architecture_problems(recipe, hf, where) + length_problems(cfg, hf, where)
