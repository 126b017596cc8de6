"""The ``nemo-run`` command line that this package adds to NeMo-Run's (`launch.cli`): the launch
files (listed in the help text; recognised and loaded without running their job), and the
arguments taken out before NeMo-Run parses the rest (executor fields, environment variables,
``--save-config`` / ``--emit-sbatch`` paths, flags).

A launch file ends in ``run.cli.main(fn, ...)`` under ``if __name__ == "__main__":``. It is checked
on its syntax tree first (`calls_nemo_run_main`: a plain script's ``__main__`` block must never
run, not even for ``--dryrun``), then run with NeMo-Run's ``LAZY_CLI``, under which
``run.cli.main`` only records its entrypoint (`load_entrypoint`).
"""

import ast
import contextlib
import difflib
import inspect
import logging
import os
import re
import runpy
import typing
from typing import Any, Iterable, Iterator, List, Optional

LAUNCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch")
"""The checkout's launch files (``launch/*.py``)."""

ADDED_OPTIONS = """Options added by this package (besides NeMo-Run's, listed by `nemo-run LAUNCH --help`):
  --dryrun                  print the resolved configuration (every field), the problems a submission
                            would have, and the sbatch script / torchrun command; submit nothing
  --save-config PATH        also write the resolved configuration (YAML) to PATH; launch it back with
                            config=PATH (overrides apply on top)
  --emit-sbatch PATH        write a plain sbatch + torchrun script of a paper recipe (no NeMo-Run or
                            container on the cluster), checked like a submission; submit nothing
  --include-uncommitted     ship the checkout's working tree (a submission with uncommitted changes is
                            refused otherwise: the job runs git archive of HEAD)
  -y, --yes                 submit without asking (-y is --yes, never NeMo-Run's --yaml)

Arguments (key=value, no dashes):
  method=NAME               stapo (default), justrl, entropy20, random, grpo, ... (stapo_megatron/method/registry.py)
  output_dir=PATH           the run folder, TrainerConfig.run_dir (absolute on Slurm; not run_dir=:
                            keys that start with run are NeMo-Run's own, run.executor.FIELD=VALUE)
  config=PATH               start from a configuration YAML (--save-config, or a run's config.yaml)
  FIELD=VALUE               a top-level TrainerConfig field: steps=100, seed=1, ...
  SECTION.FIELD=VALUE       a nested field: model.hf_dir=..., data.train_path=..., rollout.max_response_len=8192,
                            loss.tau_p=0.01, optim.lr=1e-6, logging.*, warmstart.* (tiny recipe)
  run.executor.FIELD=VALUE  an executor field: run.executor.account=..., run.executor.nodes=2,
                            run.executor.env_vars.NAME=VALUE (added to the recipe's environment)
Also: a failed job, or an error, exits non-zero naming the task and its log (NeMo-Run 0.11.1 exits 0);
run.executor.FIELD=VALUE also reaches the launch file's default executor; before a dry run or a
submission the configuration and its layout are checked, and a submission's Slurm settings, paths and
mounts, every problem listed at once (the recipe's first); a key NeMo-Run would misread (run_dir=) or a
value of the wrong type (run.executor.nodes=abc) is named in one sentence; on Slurm the save signal and the requeues follow the estimated
step time, and the job runs git archive of the checkout's HEAD.
Every field with its default and meaning: docs/config-reference.md; the resolved values of a
launch file: nemo-run LAUNCH --dryrun; all of the above explained: docs/launching.md. Cluster
settings (STAPO_* variables): stapo_megatron/launch/executors.py."""


def launch_files() -> List[str]:
    """``  launch/NAME.py  first docstring line`` of each launch file of the checkout."""
    lines = []
    for name in sorted(os.listdir(LAUNCH_DIR)) if os.path.isdir(LAUNCH_DIR) else []:
        path = os.path.join(LAUNCH_DIR, name)
        if not name.endswith(".py"):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            except SyntaxError:
                doc = ""
        lines.append(f"  {os.path.relpath(path):<24}  {doc.splitlines()[0] if doc else ''}")
    return lines


PAPER_EXECUTOR = "executors.paper_slurm_executor("
"""What a paper recipe's launch file calls for its default executor (Slurm, the recipe's nodes)."""


def paper_launch_files() -> List[str]:
    """``launch/NAME.py`` of each launch file whose default executor is a paper recipe's Slurm
    executor (the ones ``--emit-sbatch`` writes a script of)."""
    names = sorted(os.listdir(LAUNCH_DIR)) if os.path.isdir(LAUNCH_DIR) else []
    found = []
    for name in names:
        if name.endswith(".py"):
            with open(os.path.join(LAUNCH_DIR, name), encoding="utf-8") as f:
                if PAPER_EXECUTOR in f.read():
                    found.append(f"launch/{name}")
    return found


def usage(synopsis: str) -> str:
    """``nemo-run --help``: the synopsis, the launch files, the added options and arguments."""
    files = launch_files()
    listing = ("Launch files:\n" + "\n".join(files)) if files else f"(no launch files found in {LAUNCH_DIR})"
    return f"{synopsis}\n\n{listing}\n\n{ADDED_OPTIONS}\n"


def split_executor_args(args: List[str]):
    """(executor name or None, ``executor.*`` arguments without the prefix, the others)."""
    name, fields, others = None, [], []
    for arg in args:
        if arg.startswith("executor="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("executor."):
            fields.append(arg[len("executor."):])
        else:
            others.append(arg)
    return name, fields, others


def split_env_args(args: List[str]):
    """(the environment variables of ``executor.env_vars.KEY=VALUE`` and ``executor.env_vars={...}``
    arguments, the other arguments). Both forms add to the executor's environment instead of
    replacing it (NeMo-Run 0.11.1 replaces the whole dict, dropping e.g. the recipe's
    PET_SIGNALS_TO_HANDLE, and fails on the per-key form)."""
    env, others = {}, []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "executor.env_vars":
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"run.executor.env_vars={value} is not a dict: write "
                                 "run.executor.env_vars.NAME=VALUE, or run.executor.env_vars=\"{'NAME': 'VALUE'}\"")
            env.update({str(k): str(v) for k, v in parsed.items()})
        elif key.startswith("executor.env_vars."):
            env[key[len("executor.env_vars."):]] = value.strip("'\"")
        else:
            others.append(arg)
    return env, others


def split_save_config(args: List[str], option: str = "--save-config"):
    """(the ``--save-config PATH`` / ``--save-config=PATH`` value or None, the other arguments;
    likewise for another ``option`` with a path)."""
    path, others, it = None, [], iter(args)
    for arg in it:
        if arg == option:
            path = next(it, None)
            if path is None:
                raise ValueError(f"{option} needs a file path")
        elif arg.startswith(f"{option}="):
            path = arg.split("=", 1)[1]
        else:
            others.append(arg)
    return path, others


def split_flag(args: List[str], flag: str):
    """(whether ``flag`` is among ``args``, the other arguments)."""
    return flag in args, [a for a in args if a != flag]


RUN_KEY_ALIASES = {"run_dir": "output_dir"}
"""Settings a launch spells differently from the configuration (`TrainerConfig.run_dir` is
``output_dir=`` on the command line)."""


def run_key_problem(args: Iterable[str], settings: List[str]) -> Optional[str]:
    """Why a ``key=value`` argument whose key starts with ``run`` but not ``run.`` (``run_dir=/x``)
    cannot be given (NeMo-Run 0.11.1 takes every such key for its own ``run.*`` options and fails
    with "Run overwrites must start with 'run.'"), naming the setting meant: its alias
    (`RUN_KEY_ALIASES`) or the closest of ``settings`` (the launch's own); None when there is none."""
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or arg.startswith("-") or not key.startswith("run") or key[3:4] in ("", ".", "["):
            continue
        alias = RUN_KEY_ALIASES.get(key)
        if alias in settings:
            hint = f"; the run's folder is {alias}={value}"
        else:
            close = difflib.get_close_matches(key, settings, n=3)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        return (f"unknown setting {key!r}{hint}. (Keys that start with 'run' are NeMo-Run's own options: "
                f"run.executor.FIELD=VALUE; nemo-run --help lists the settings.)")
    return None


TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              list: "a list such as ['a', 'b']", dict: "a dict such as {'a': 1}", tuple: "a tuple such as (1, 2)"}
"""How a message names the type a NeMo-Run override expects (`expected`)."""


def expected(annotation: Any) -> str:
    """``annotation`` in words: ``an integer``, ``an integer or None``, ``one of 'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        words = " or ".join(expected(a) for a in args if a is not type(None))
        return words + (" or None" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    base = origin or annotation
    return TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))


def _settings_of(config: Any) -> List[str]:
    """The keyword names a NeMo-Run ``Config`` / ``Partial`` takes (its target's parameters)."""
    target = getattr(config, "__fn_or_cls__", None)
    if target is None:
        return []
    return [p.name for p in inspect.signature(target).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _parse_error_context(error: Exception) -> dict:
    """The key, value and expected type of NeMo-Run's parse error (those it has)."""
    reason = getattr(error, "reason", None)  # NeMo-Run re-raises a ParseError with its context as the reason
    return reason if isinstance(reason, dict) else getattr(error, "context", None) or {}


def run_option_prefix(error: Exception, args: Iterable[str]) -> str:
    """``run.executor.`` when the key of NeMo-Run's parse ``error`` is one of the ``executor.*``
    ``args`` (``run.`` taken off), else ``run.``."""
    key = _parse_error_context(error).get("key")
    return "run.executor." if key and any(a.startswith(f"executor.{key}") for a in args) else "run."


def parse_error_message(error: Exception, prefix: str, root: Any = None) -> str:
    """One sentence for NeMo-Run's parse error of an override ``prefix + key=value`` (its own text
    repeats the value three times with a context dict): the type the key expects
    (``run.executor.nodes expects an integer, got 'abc'``), or, for a key ``root`` (the
    ``Config`` parsed into) does not have, the closest ones."""
    context = _parse_error_context(error)
    key, value = context.get("key"), context.get("value")
    if key is not None and "expected_type" in context:
        return f"{prefix}{key} expects {expected(context['expected_type'])}, got {value!r}"
    text = re.sub(r" \(Argument: .*", "", str(error.args[0]) if error.args else str(error), flags=re.S)
    if key is not None and "No parameter named" in text:
        owner, _, name = key.rpartition(".")
        target = root
        for part in owner.split(".") if owner else []:
            target = getattr(target, part, None)
        names = _settings_of(target)
        if not names:
            return f"unknown setting {prefix}{key}"
        kind = target.__fn_or_cls__.__name__
        close = difflib.get_close_matches(name, names, n=3)
        hint = (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close
                else f"; its settings: {', '.join(names)}")
        return f"unknown setting {prefix}{key}: {kind} has no {name!r}{hint}"
    return f"{prefix}{key}={value}: {text}" if key is not None else text


@contextlib.contextmanager
def quiet_parser() -> Iterator[None]:
    """Keep NeMo-Run's parser from logging its raw error before the caller names it (`parse_error_message`)."""
    logger = logging.getLogger("nemo_run.cli.cli_parser")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def calls_nemo_run_main(path: str) -> bool:
    """Whether the file's source calls NeMo-Run's CLI entry (``run.cli.main(...)``,
    ``nemo_run.cli.main(...)``, ``cli.main(...)`` or ``main(...)`` imported from ``nemo_run.cli``).

    Checked on the syntax tree, before anything runs: a plain script would otherwise have its
    ``__main__`` block executed by ``load_entrypoint`` (even under ``--dryrun``).
    """
    with open(path, encoding="utf-8") as f:
        try:
            tree = ast.parse(f.read(), filename=path)
        except SyntaxError as e:
            raise ValueError(f"launch file {path} is not valid Python: {e}") from None
    main_names = {alias.asname or alias.name for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module == "nemo_run.cli"
                  for alias in node.names if alias.name == "main"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "main":
            owner = func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "cli") or (
                    isinstance(owner, ast.Name) and owner.id == "cli"):
                return True
        if isinstance(func, ast.Name) and func.id in main_names:
            return True
    return False


def load_entrypoint(path: str):
    """The entrypoint a launch file registers, without running it.

    The file runs as ``__main__`` with ``LAZY_CLI=true``: NeMo-Run's ``run.cli.main`` then only
    records its entrypoint (with the default executor / factory / plugins it was given) in
    ``nemo_run.cli.api.MAIN_ENTRYPOINT``; NeMo-Run's own script loader works the same way.
    """
    from nemo_run.cli import api as cli_api

    if not os.path.isfile(path):
        raise FileNotFoundError(f"launch file {path} does not exist")
    if not calls_nemo_run_main(path):
        raise ValueError(f"{path} is not a launch file: it never calls nemo_run.cli.main(fn, ...) "
                         "(not run; a plain script runs with python, not nemo-run)")
    previous = os.environ.get("LAZY_CLI")
    os.environ["LAZY_CLI"] = "true"
    cli_api.MAIN_ENTRYPOINT = None
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        if previous is None:
            os.environ.pop("LAZY_CLI")
        else:
            os.environ["LAZY_CLI"] = previous
    if cli_api.MAIN_ENTRYPOINT is None:
        raise ValueError(f"{path} does not call nemo_run.cli.main(fn, ...) under `if __name__ == '__main__':`")
    return cli_api.MAIN_ENTRYPOINT
