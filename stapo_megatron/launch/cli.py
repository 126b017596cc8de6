"""``nemo-run LAUNCH_FILE [key=value ...] [config=PATH] [run.executor=NAME] [--dryrun] [--save-config PATH] [--emit-sbatch PATH] [--include-uncommitted] [--yes] ...``

Runs a launch file (one that ends in ``run.cli.main(fn, ...)``) with NeMo-Run's own command
line: the same ``key=value`` parsing, ``run.executor=NAME`` / ``run.executor.<field>=value``,
``--dryrun``, ``--yes``, ``--detach``, ``--name``. (nemo-run itself installs only the ``nemo``
and ``nemorun`` commands; this package provides ``nemo-run``.) What it adds is listed once, in
`arguments.ADDED_OPTIONS` (printed by ``nemo-run --help``); docs/launching.md explains each addition.

This module is the NeMo-Run RunContext subclass and the console entry; each addition lives in its
own module: launch files and arguments `arguments`, dry-run rendering and failed jobs `jobs`, the
checks before a submission `preflight` and `executors.check_submission`, the save signal and the
requeue budget `timing`, the job scripts' requeue rules `requeue`, the code a job runs `shipping`.
"""

import contextlib
import dataclasses
import inspect
import os
import sys
import time
import warnings
from typing import Iterator, List, Optional

# leptonai 0.27 (imported by nemo_run) imports fastapi's WSGI middleware, which starlette >= 1.0
# deprecates with a warning on every start
warnings.filterwarnings("ignore", message=".*starlette.middleware.wsgi is deprecated")

import fiddle as fdl  # noqa: E402
import typer  # noqa: E402

import nemo_run as run  # noqa: E402
from nemo_run.cli import api as cli_api  # noqa: E402
from nemo_run.cli.cli_parser import CLIException, parse_cli_args  # noqa: E402

from stapo_megatron.config.tree import TrainerConfig  # noqa: E402
from stapo_megatron.config.yaml_io import dump_config  # noqa: E402
from stapo_megatron.launch import entry, executors, preflight, requeue, shipping, timing  # noqa: E402
from stapo_megatron.launch.arguments import (ADDED_OPTIONS, paper_launch_files, parse_error_message,  # noqa: E402
                                             quiet_parser, run_key_problem, run_option_prefix, split_env_args,
                                             split_executor_args, split_flag, split_save_config, usage)
from stapo_megatron.launch.jobs import failed_jobs, render_dryrun  # noqa: E402
from stapo_megatron.launch.arguments import calls_nemo_run_main, load_entrypoint  # noqa: E402, F401

USAGE = __doc__.split("\n\n")[0]


class CheckedRunContext(cli_api.RunContext):
    """NeMo-Run's RunContext with the additions listed in the module docstring."""

    save_config: Optional[str] = None
    """Where ``--save-config`` writes the resolved configuration (set by `main`)."""

    emit_sbatch: Optional[str] = None
    """Where ``--emit-sbatch`` writes a plain sbatch + torchrun script (set by `main`)."""

    include_uncommitted: bool = False
    """``--include-uncommitted``: ship the checkout's working tree, not its HEAD (set by `main`)."""

    code_dir: Optional[str] = None
    """The checkout a Slurm job's code comes from (set by `_preflight`); NeMo-Run's Slurm packaging
    runs ``git rev-parse`` in the working directory, so the launch runs there after the checks."""

    given: frozenset = frozenset()
    """The executor fields set on the command line (``run.executor.signal=...``): kept as given,
    not derived from the configuration (set by `parse_args`)."""

    run_dir: Optional[str] = None
    """The run folder of a recipe's job as the batch host sees it (set by `_recipe`)."""

    def parse_args(self, args: List[str], lazy: bool = False):
        env, args = split_env_args(args)
        name, fields, others = split_executor_args(args)
        self.given = frozenset(f.partition("=")[0] for f in fields)
        default = getattr(self, "executor", None)
        if name is None and fields and default is not None:
            config = default.to_config() if isinstance(default, run.Executor) else default
            with parse_errors_named("run.executor.", config):
                self.executor = parse_cli_args(config, fields)
            args = others
        with parse_errors_named(lambda error: run_option_prefix(error, args)):
            remaining = super().parse_args(args, lazy)
        if env:
            if self.executor is None:
                raise ValueError("run.executor.env_vars needs an executor")
            self.executor.env_vars = {**self.executor.env_vars, **env}
        return remaining

    def parse_fn(self, fn, args: List[str], **default_kwargs):
        with parse_errors_named(""):
            task = super().parse_fn(fn, args, **default_kwargs)
        self.task = task
        self._preflight(task)
        return task

    def _preflight(self, task) -> None:
        """Fail before submitting or rendering, listing every problem: the recipe's first (`_recipe`:
        its layout, paths and model folder), then the executor's missing settings (a dry run shows
        them as ``<unset:...>`` instead) and the code a Slurm job would not get
        (`shipping.code_problems`)."""
        problems = []
        is_recipe = getattr(task, "__fn_or_cls__", None) is entry.run_recipe
        if self.emit_sbatch and (not isinstance(self.executor, run.SlurmExecutor) or not is_recipe):
            raise cli_api.RunContextError(emit_sbatch_refusal(self.executor, is_recipe))
        if is_recipe:
            problems += self._recipe(task)
        if self.executor is not None and not self.dryrun:
            problems += executors.unset_settings(self.executor) + executors.missing_sbatch(self.executor)
        if not self.emit_sbatch:
            code, self.code_dir = shipping.code_problems(self.executor, self.include_uncommitted)
            problems += self._refuse_or_show(code)
        if problems:
            raise cli_api.RunContextError(("no script written" if self.emit_sbatch else "not launched")
                                          + ":\n- " + "\n- ".join(problems))
        if self.code_dir:
            os.chdir(self.code_dir)

    def _recipe(self, task) -> List[str]:
        """Build the task's final configuration (a dry run does not require the paths a user fills
        in later), show it, fit the executor to it (save signal, requeue budget, requeue rules) and
        return its problems (`preflight.job_problems`, `timing.report`)."""
        executor, submitting = self.executor, not self.dryrun or bool(self.emit_sbatch)
        slurm = isinstance(executor, run.SlurmExecutor)
        if slurm and self.emit_sbatch:  # the plain script runs no container
            executor.container_image, executor.container_mounts = None, []
        if slurm and task.recipe not in entry.TINY and not task.output_dir and not task.config:
            task.output_dir = preflight.OUTPUT_DIR_PLACEHOLDER  # rendered visibly; a submission refuses it
        kwargs = dict(fdl.build(task).keywords)
        if slurm:
            kwargs.update(num_nodes=executor.nodes, gpus_per_node=executor.gpus_per_node)
        elif isinstance(executor, run.LocalExecutor):
            kwargs.update(num_nodes=executor.nodes, gpus_per_node=executor.ntasks_per_node)
        problems = []
        try:
            cfg, warmstart = entry.build_config(check_paths=submitting, **kwargs)
        except ValueError as e:  # the recipe's own checks: with the paths unchecked, the rest still runs
            problems.append(str(e))
            try:
                cfg, warmstart = entry.build_config(check_paths=False, **kwargs)
            except ValueError:
                return problems
        recipe = kwargs["recipe"]
        self._show_config(cfg, warmstart, recipe)
        checks = []
        if slurm:
            if recipe not in entry.TINY:
                timing.apply_final(executor, recipe, cfg, self.given)
                checks += timing.report(cfg, recipe, executor)
            self.run_dir = preflight.host_run_dir(cfg, executor)
            setup = requeue.nemo_run_setup(self.run_dir)
            executor.setup_lines = f"{executor.setup_lines}\n{setup}" if executor.setup_lines else setup
        checks += preflight.job_problems(cfg, recipe, kwargs.get("config"), executor)
        return problems + self._refuse_or_show(checks)

    def _show_config(self, cfg, warmstart, recipe: str) -> None:
        """Print (dry run) and / or write (``--save-config``) the resolved configuration."""
        text = dump_config(cfg, warmstart, recipe)
        if self.dryrun and not self.emit_sbatch:
            print(f"# ---- resolved configuration (dry run) ----\n{text}", flush=True)
        if self.save_config:  # its folder too: the docs save it on the shared file system, maybe new
            os.makedirs(os.path.dirname(self.save_config), exist_ok=True)
            with open(self.save_config, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote the resolved configuration to {self.save_config} (launch it with config={self.save_config})")

    def _refuse_or_show(self, problems: List[str]) -> List[str]:
        """A real submission refuses ``problems``; a dry run renders the job and lists them."""
        if self.dryrun and not self.emit_sbatch and problems:
            print("# ---- a submission would be refused (dry run; fix these before launching) ----\n- "
                  + "\n- ".join(problems), flush=True)
            return []
        return problems

    def cli_execute(self, fn, args: List[str], entrypoint_type: str = "task"):
        started_ns = time.time_ns()
        working_dir = os.getcwd()
        try:
            super().cli_execute(fn, args, entrypoint_type)  # `_preflight` enters `code_dir`
            if self.emit_sbatch:
                self._write_sbatch()
                return
            if self.dryrun:
                if entrypoint_type == "task" and self.executor is not None:
                    render_dryrun(self.task, self.executor, self.name)
                return
        finally:
            os.chdir(working_dir)
        failures = failed_jobs(started_ns)
        if failures:
            raise cli_api.RunContextError("\n".join(failures))

    def _write_sbatch(self) -> None:
        """``--emit-sbatch``: the checked task as a plain sbatch + torchrun script."""
        kwargs = dict(fdl.build(self.task).keywords)
        root = shipping.code_root()
        if not root:
            raise cli_api.RunContextError("--emit-sbatch: this package is not in a checkout the nodes can run "
                                          "(set STAPO_CODE_DIR to the clone with its .venv)")
        script = executors.plain_sbatch_script(self.executor, kwargs["recipe"], entry.format_arguments(kwargs),
                                               root, self.name, self.run_dir)
        with open(self.emit_sbatch, "w", encoding="utf-8") as f:
            f.write(script)
        os.chmod(self.emit_sbatch, 0o755)
        print(f"wrote {self.emit_sbatch}: submit it with `sbatch {self.emit_sbatch}` (plain sbatch + torchrun, "
              f"the code and .venv of {root})", flush=True)


def emit_sbatch_refusal(executor, is_recipe: bool) -> str:
    """Why ``--emit-sbatch`` writes nothing for this launch file, and the files it does write."""
    what = ("runs a recipe" if is_recipe else "does not run a recipe (`entry.run_recipe`)")
    where = type(executor).__name__ if executor is not None else "no executor"
    return (f"--emit-sbatch writes the sbatch script of a recipe on a Slurm executor; this launch file {what} "
            f"on {where}" + (" (this machine: run it with --yes, or see its command with --dryrun)"
                             if isinstance(executor, run.LocalExecutor) else "")
            + f". The paper recipes' launch files: {', '.join(paper_launch_files())}")


@contextlib.contextmanager
def parse_errors_named(prefix, root=None) -> Iterator[None]:
    """NeMo-Run's parse errors of ``prefix + key=value`` overrides as one sentence
    (`arguments.parse_error_message`), refused as a RunContextError ("Error: ...", exit code 1).
    ``prefix``: the text, or a function of the error that returns it."""
    try:
        with quiet_parser():
            yield
    except CLIException as e:
        text = prefix(e) if callable(prefix) else prefix
        raise cli_api.RunContextError(parse_error_message(e, text, root)) from None


def launch_settings(fn) -> List[str]:
    """The ``key=value`` settings a launch file's function takes: its parameters, and for a recipe
    the top-level `TrainerConfig` fields (``run_dir`` is ``output_dir``)."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if fn is entry.run_recipe:
        names += [f.name for f in dataclasses.fields(TrainerConfig) if f.name not in names and f.name != "run_dir"]
    return names


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point; returns the exit code (0 only if every job succeeded)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(USAGE) if argv else USAGE + "\n(nemo-run --help lists the launch files and the options)")
        return 0 if argv else 2
    path, args = argv[0], argv[1:]
    try:
        CheckedRunContext.save_config, args = split_save_config(args)
        CheckedRunContext.emit_sbatch, args = split_save_config(args, "--emit-sbatch")
    except ValueError as e:
        print(f"nemo-run: {e}", file=sys.stderr)
        return 2
    CheckedRunContext.include_uncommitted, args = split_flag(args, "--include-uncommitted")
    # relative to where nemo-run was started (a Slurm launch runs in the checkout after the checks)
    for attribute in ("save_config", "emit_sbatch"):
        if getattr(CheckedRunContext, attribute):
            setattr(CheckedRunContext, attribute, os.path.abspath(getattr(CheckedRunContext, attribute)))
    if CheckedRunContext.emit_sbatch and "--dryrun" not in args:
        args.append("--dryrun")  # NeMo-Run then submits nothing
    # NeMo-Run gives -y to both --yaml and --yes (click keeps the later, --yes): say so explicitly
    args = ["--yes" if a == "-y" else a for a in args]
    if "-h" in args or "--help" in args:
        print(ADDED_OPTIONS + "\n", flush=True)
    # local jobs start `torchrun` / `python` through PATH: use this environment's (.venv/bin),
    # also when the venv is not activated (`make demo` calls .venv/bin/nemo-run)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    try:
        ep = load_entrypoint(path)
    except (OSError, ValueError) as e:
        print(f"nemo-run: {e}", file=sys.stderr)
        return 2
    misread = run_key_problem(args, launch_settings(ep.fn))
    if misread:
        print(f"nemo-run: {misread}", file=sys.stderr)
        return 2
    app = typer.Typer(pretty_exceptions_enable=False)
    CheckedRunContext.cli_command(
        app, ep.name, ep.fn, default_factory=ep.default_factory, default_executor=ep.default_executor,
        default_plugins=ep.default_plugins, type=ep.type, is_main=True,
    )
    try:
        code = app(args=args, prog_name=f"nemo-run {path}", standalone_mode=False)
    except (typer.Abort, KeyboardInterrupt):
        print("nemo-run: aborted", file=sys.stderr)
        return 130
    except Exception as e:  # click's usage errors, which standalone mode would print
        print(f"nemo-run: {e}", file=sys.stderr)
        return 2
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
