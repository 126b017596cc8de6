"""The function a launched task runs in every worker process: recipe name + method + overrides.

NeMo-Run (``launch/*.py``) serialises a call of `run_recipe` and runs it under torchrun (local)
or srun + torchrun (Slurm). On the worker, the recipe's `TrainerConfig` is built from its name,
the method and the ``key=value`` overrides of the command line (`build_config`), and then
`stapo_megatron.trainer.loop.train` runs exactly as ``examples/demo_rl.py`` runs it. No nemo_run
import here: the worker only needs the package. (No ``from __future__ import annotations``:
NeMo-Run parses command-line values with these signatures' real annotations.)

Overrides: top-level `TrainerConfig` fields as keywords (``steps=1``), nested ones through the
section dicts (``rollout.max_response_len=8192`` arrives as ``rollout={"max_response_len": 8192}``),
the tiny recipe's warm-start through ``warmstart``. They are applied by the one override parser,
``stapo_megatron.config.overrides.apply_overrides``: unknown fields (with the closest names) and wrongly
typed values raise ValueError naming the field.

Without NeMo-Run (a plain ``sbatch`` + ``torchrun`` job, ``nemo-run LAUNCH --emit-sbatch``):

    torchrun --nproc-per-node 8 ... -m stapo_megatron.launch.entry RECIPE [method=...] [key=value ...]

(`main`: the same arguments as the launch files, ``section.field=value`` for nested fields.)
"""

import ast
import dataclasses
import inspect
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch.distributed.elastic.multiprocessing.errors import record

from stapo_megatron.launch import requeue
from stapo_megatron.trainer import faults
from stapo_megatron.trainer.config import WarmStartConfig
from stapo_megatron.trainer.preemption import StoppedForRequeue
from stapo_megatron.config import TrainerConfig
from stapo_megatron.config.yaml_io import load_config
from stapo_megatron.method.registry import get_method
from stapo_megatron.config.parallel_layout import config_problems
from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.mcore.parallel import init_process_group
from stapo_megatron.rollout.transport import init_job
from stapo_megatron.recipes import lora, paper

RECIPES = ("tiny", "tiny_moe", "tiny_lora", "tiny_qwen35", *paper.LAYOUTS, *lora.LAYOUTS)
"""Recipe names: the CPU demos (``recipes/tiny.py``), the paper's sizes (``recipes/paper.py``) and
their LoRA variants (``recipes/lora.py``)."""
TINY = ("tiny", "tiny_moe", "tiny_lora", "tiny_qwen35")
"""The CPU demos: they prepare their model folder and take a warm-start."""

def _subsections(config_type) -> Dict[str, Any]:
    """The dataclass-valued fields of a config dataclass, each with its own, as a tree of dicts."""
    return {f.name: _subsections(f.default_factory) for f in dataclasses.fields(config_type)
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}


SUBSECTIONS = {**_subsections(TrainerConfig), "lora": {}, "warmstart": _subsections(WarmStartConfig)}
"""Section -> the tree of its own sections (``{"loss": {"rollout_correction": {}}, ...}``): where
a nested ``section.sub.field=value`` override goes (a launch task holds a dict per node)."""

SECTIONS = tuple(SUBSECTIONS)
"""Config sections that take nested ``section.field=value`` overrides: the dataclass-valued
fields of `TrainerConfig`, the optional ``lora`` section (``lora.rank=64``; an empty one leaves
the recipe's as it is) and the warm-start (`run_recipe` names each as a parameter)."""

Value = Optional[Union[int, float, bool, str]]
"""What one ``key=value`` override can be: NeMo-Run parses the text as the first type that fits
(int before bool, so `steps=1` is 1 and `bf16=true` is True)."""

def section(**fields: Value) -> Dict[str, Value]:
    """The ``section.field=value`` overrides of one config section, as a dict (a launch task
    holds ``run.Config(section)`` per section for NeMo-Run to set attributes on)."""
    return dict(fields)


def build_config(
    recipe: str,
    method: Optional[str] = None,
    output_dir: Optional[str] = None,
    config: Optional[str] = None,
    check_paths: bool = True,
    num_nodes: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
    **overrides: Any,
) -> Tuple[Any, Optional[Any]]:
    """The (TrainerConfig, WarmStartConfig or None) of a recipe with overrides applied.

    Args:
        recipe: one of `RECIPES`.
        method: a name of `stapo_megatron.method.registry.METHODS` (None: "stapo", or the method of
            ``config``).
        output_dir: the run directory (TrainerConfig.run_dir; ``run_dir=`` itself cannot be
            given on NeMo-Run's command line, where every ``run*`` key belongs to NeMo-Run).
        config: a configuration YAML (``nemo-run ... --save-config PATH``, or a run folder's
            config.yaml) to start from instead of the recipe's defaults; written for the same
            recipe. The overrides apply on top of it.
        check_paths: paper recipes: require the model and data paths (False for a dry run).
        num_nodes, gpus_per_node: paper recipes: the job's GPUs, to check the layout against
            (default: the recipe's own `memory.ParallelLayout`).
        overrides: TrainerConfig fields; the `SECTIONS` as dicts (None or {} = unchanged).
    Raises:
        ValueError: unknown recipe, method, field or value type; for paper recipes every
            inconsistency of the parallel layout and (with ``check_paths``) missing paths.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if method is not None:
        get_method(method)  # before building anything: a ValueError naming the methods
    sections = {name: overrides.pop(name) or {} for name in SECTIONS if name in overrides}
    if not sections.get("lora"):  # a launch task holds every section: an empty one must not turn LoRA on
        sections.pop("lora", None)
    warmstart_overrides = sections.pop("warmstart", {})
    if config:
        cfg, warmstart = _from_yaml(config, recipe, method, output_dir)
    elif recipe in TINY:
        from stapo_megatron.recipes.tiny import TINY_RECIPES

        run_dir = output_dir or {"tiny": "runs/demo", "tiny_moe": "runs/demo-moe", "tiny_lora": "runs/demo-lora",
                              "tiny_qwen35": "runs/demo-qwen35"}[recipe]
        cfg, warmstart = TINY_RECIPES[recipe](run_dir=run_dir, method=method or "stapo")
    else:
        cfg, warmstart = lora.recipe_module(recipe).paper_recipe(recipe, method or "stapo", run_dir=output_dir), None
    try:
        cfg = apply_overrides(cfg, {**overrides, **sections})
    except ValueError as refusal:
        if recipe in TINY:
            raise
        raise _every_layout_problem(recipe, cfg, {**overrides, **sections}, refusal, num_nodes, gpus_per_node,
                                    check_paths) from None
    if warmstart_overrides:
        if warmstart is None:
            raise ValueError(f"recipe {recipe} has no warm-start; drop the warmstart.* overrides")
        warmstart = apply_overrides(warmstart, warmstart_overrides, "warmstart.")
    if recipe not in TINY:
        lora.recipe_module(recipe).check_paper_config(recipe, cfg, num_nodes, gpus_per_node, check_paths)
    return cfg, warmstart


def _every_layout_problem(recipe: str, cfg: Any, overrides: Dict[str, Any], refusal: ValueError,
                          num_nodes: Optional[int], gpus_per_node: Optional[int], check_paths: bool) -> ValueError:
    """The error of a paper recipe whose overrides `TrainerConfig` refused (``refusal``) at the
    first of its layout problems: every problem of the layout and paths (`paper.check_paper_config`
    on the configuration unchecked), so that e.g. TP=3 on Qwen3-14B names its 40 heads and 8 KV
    heads, not only a token budget TP=3 changes. Any other refusal is returned as it is."""
    unchecked = apply_overrides(cfg, overrides, check=False)
    if str(refusal) not in config_problems(unchecked):
        return refusal
    try:
        lora.recipe_module(recipe).check_paper_config(recipe, unchecked, num_nodes, gpus_per_node, check_paths)
    except ValueError as listed:
        return listed
    return refusal


def _from_yaml(path: str, recipe: str, method: Optional[str], output_dir: Optional[str]) -> Tuple[Any, Optional[Any]]:
    """The configuration of a YAML file for ``recipe``, with ``output_dir`` as its run_dir."""
    written_for, cfg, warmstart = load_config(path)
    if written_for is not None and written_for != recipe:
        raise ValueError(f"{path} holds a configuration of recipe {written_for!r}, not {recipe!r}: "
                         f"launch it with that recipe's launch file")
    if method is not None and method != cfg.loss.method:
        raise ValueError(f"method={method} but {path} has loss.method={cfg.loss.method!r}: with config=, "
                         f"set loss.method (and the loss fields) or edit the file")
    if output_dir:
        cfg = dataclasses.replace(cfg, run_dir=output_dir)
    return cfg, warmstart


def _prepare_tiny_model(model_dir: str, recipe: str = "tiny", transport=None) -> None:
    """Global rank 0 writes the tiny model folder (atomically); the other ranks wait for it at a
    barrier of the already formed process group (a failure of rank 0 ends their wait at once;
    separate placement: the job-wide group of ``transport``).

    Global, not local: with several nodes sharing the output folder, one writer per node would
    race to rename its copy into place.
    """
    import torch.distributed as dist

    from stapo_megatron.recipes.tiny import prepare_tiny_model

    if int(os.environ.get("RANK", "0")) == 0:
        prepare_tiny_model(model_dir, recipe)
    if transport is not None:
        transport.data.barrier().wait()
    else:
        dist.barrier()


def _run_engine_rank(cfg: TrainerConfig, transport) -> None:
    """An engine rank of a separately placed job: the engine wing's runtime with the run's rollout
    and model sections, this engine's seed, whether the trainers want routes and the run's
    ``lora.rank``."""
    from stapo_megatron.bridge.hf_config import load_hf_config
    from stapo_megatron.serve.server import run_engine_rank
    from stapo_megatron.trainer.preemption import DEFAULT_SIGNALS
    from stapo_megatron.trainer.routing import routes_wanted
    from stapo_megatron.trainer.seeds import Seeds

    seed = Seeds(cfg.seed, None, cfg.data.seed).engine(transport.engine_index)
    run_engine_rank(cfg.rollout, cfg.model, cfg.longest_sequence(), transport, seed,
                    routes_wanted(cfg.rollout, load_hf_config(cfg.model.hf_dir)), DEFAULT_SIGNALS,
                    None if cfg.lora is None else cfg.lora.rank)


@record  # torchrun's summary then shows the error (e.g. the rank that failed first), not "N/A"
def run_recipe(
    recipe: str = "tiny",
    method: Optional[str] = None,
    output_dir: Optional[str] = None,
    config: Optional[str] = None,
    model: Optional[Dict[str, Value]] = None,
    data: Optional[Dict[str, Value]] = None,
    rollout: Optional[Dict[str, Value]] = None,
    loss: Optional[Dict[str, Value]] = None,
    optim: Optional[Dict[str, Value]] = None,
    logging: Optional[Dict[str, Value]] = None,
    reward: Optional[Dict[str, Value]] = None,
    eval: Optional[Dict[str, Value]] = None,  # noqa: A002  (the config section's name)
    warmstart: Optional[Dict[str, Value]] = None,
    lora: Optional[Dict[str, Value]] = None,
    **overrides: Value,
) -> None:
    """Train one recipe in this worker process (one per GPU / CPU rank, under torchrun).

    The tiny recipe first prepares its model folder (``<output_dir>/model``) on global rank 0.
    Arguments as in `build_config`; ``model`` ... ``warmstart`` are the section overrides.
    A failure is recorded in ``<output_dir>/failures`` (`stapo_megatron.trainer.faults`); a rank that
    only lost its peers raises a `faults.PeerFailure` naming the rank that failed first. A stop on
    the scheduler's warning signal leaves `requeue.STOPPED_MARKER` in the run folder (torchrun
    does not pass the workers' exit code 75 on; the job script reads the mark).
    """
    # torchrun's environment: the layout check uses the GPUs this job really has
    world, per_node = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cfg, warmstart_cfg = build_config(
        recipe, method, output_dir, config=config, num_nodes=world // per_node, gpus_per_node=per_node, model=model,
        data=data, rollout=rollout, loss=loss, optim=optim, logging=logging, reward=reward, eval=eval,
        warmstart=warmstart, lora=lora, **overrides,
    )
    faults.clear_record(cfg.run_dir)
    try:
        # the group forms first (under cfg.init_timeout_s), so that the shared setup below can
        # wait at a barrier; separate placement splits the job into trainers and engines
        transport = None
        if cfg.rollout.placement == "separate":
            transport = init_job(cfg.rollout.separate.engine_ranks, cfg.rollout.tensor_parallel_size, cfg.init_timeout_s,
                              cfg.distributed_timeout_s, cfg.rollout_timeout())
        else:
            init_process_group(cfg.init_timeout_s, cfg.distributed_timeout_s)
        if recipe in TINY:
            _prepare_tiny_model(cfg.model.hf_dir, recipe, transport)
        if transport is not None and transport.is_engine:
            _run_engine_rank(cfg, transport)
            return
        from stapo_megatron.trainer.loop import train

        train(cfg, warmstart_cfg, transport)
    except StoppedForRequeue as stop:  # saved on the warning signal: the job script requeues on this mark
        if int(os.environ.get("RANK", "0")) == 0:
            requeue.mark_stopped(cfg.run_dir, stop.step)
        raise
    except Exception as error:
        raise faults.failed(cfg.run_dir, error)


# NeMo-Run builds `run_recipe`'s command line from its signature: every section needs a parameter.
assert set(SECTIONS) <= set(inspect.signature(run_recipe).parameters), SECTIONS


WORDS = {"true": True, "false": False, "null": None, "none": None}
"""Values spelled as the dumped YAML and NeMo-Run's command line spell them (any case): the same
``model.sequence_parallel=false`` works with ``nemo-run`` and with this entry."""


def _value(text: str) -> Value:
    """A command-line value: a Python literal (``1``, ``0.5``, ``True``, ``None``), a YAML word of
    `WORDS` (``true``, ``false``, ``null``), or the text."""
    if text.strip().lower() in WORDS:
        return WORDS[text.strip().lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_arguments(args: Sequence[str]) -> Dict[str, Any]:
    """`run_recipe`'s keyword arguments from ``key=value`` texts: ``section.field=value`` (the
    `SECTIONS`) into that section's dict (``loss.rollout_correction.mode=tis`` into the loss
    dict's ``rollout_correction`` dict: `SUBSECTIONS`), the others as keywords (``method=``, ``output_dir=``,
    ``config=``, top-level fields). ValueError for a text without ``=``."""
    arguments: Dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {arg!r}")
        section_name, dot, field = key.partition(".")
        if dot and section_name in SECTIONS:
            node, tree, parts = arguments.setdefault(section_name, {}), SUBSECTIONS[section_name], field.split(".")
            while len(parts) > 1 and parts[0] in tree:  # a section's own section: a dict of its own
                node, tree = node.setdefault(parts[0], {}), tree[parts.pop(0)]
            node[".".join(parts)] = _value(value)
        else:
            arguments[key] = _value(value)
    return arguments


def format_arguments(kwargs: Dict[str, Any]) -> List[str]:
    """The ``key=value`` texts `parse_arguments` reads back into ``kwargs`` (a launch task's
    arguments without ``recipe``; None and empty sections, at any depth, left out)."""
    def text(value: Any) -> str:  # a string that would read back as another literal is quoted
        return value if isinstance(value, str) and _value(value) == value else repr(value)

    def fields(prefix: str, section: Dict[str, Any], tree: Dict[str, Any]) -> List[str]:
        out = []
        for field, value in section.items():
            if field in tree and isinstance(value, dict):  # a section's own section
                out += fields(f"{prefix}{field}.", value, tree[field])
            else:
                out.append(f"{prefix}{field}={text(value)}")
        return out

    texts = []
    for key, value in kwargs.items():
        if key == "recipe" or value is None:
            continue
        if key in SECTIONS:
            texts += fields(f"{key}.", value, SUBSECTIONS[key])
        else:
            texts.append(f"{key}={text(value)}")
    return texts


USAGE = ("usage: torchrun [torchrun options] -m stapo_megatron.launch.entry RECIPE [method=NAME] "
         "[output_dir=PATH] [config=PATH] [key=value | section.field=value ...]\n"
         f"RECIPE: one of {', '.join(RECIPES)}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m stapo_megatron.launch.entry RECIPE key=value ...`` (under torchrun): `run_recipe`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    recipe, rest = argv[0], argv[1:]
    if recipe not in RECIPES:
        raise SystemExit(f"recipe must be one of {RECIPES}, got {recipe!r}\n{USAGE}")
    try:
        arguments = parse_arguments(rest)
    except ValueError as e:
        raise SystemExit(f"{e}\n{USAGE}")
    run_recipe(recipe, **arguments)


if __name__ == "__main__":
    main()
