"""``nemo-run LAUNCH_FILE [key=value ...] [config=PATH] [run.executor=NAME] [--dryrun] [--save-config PATH] [--emit-sbatch PATH] [--include-uncommitted] [--yes] ...``

Runs a launch file (one that ends in ``run.cli.main(fn, ...)``) with NeMo-Run's own command
line: the same ``key=value`` parsing, ``run.executor=NAME`` / ``run.executor.<field>=value``,
``--dryrun``, ``--yes``, ``--detach``, ``--name``. (nemo-run itself installs only the ``nemo``
and ``nemorun`` commands; this package provides ``nemo-run``.) What it adds:

- the exit code: NeMo-Run 0.11.1 returns 0 when a job fails, and also when its CLI catches an
  error; here a failed job (its state after the run) or an error exits non-zero, naming the
  failed task and where its log is;
- ``--dryrun`` also renders the scheduler request (the sbatch script, the torchrun command)
  through ``Experiment.dryrun``, which writes files locally and never connects to a cluster;
- ``run.executor.<field>=value`` also applies to the launch file's default executor (NeMo-Run
  0.11.1 applies executor fields only together with ``run.executor=NAME``);
- before a real submission and before a dry run, the task's recipe is built with its overrides
  and checked (``entry.build_config``, the one override parser: an unknown field names the
  closest ones); a real submission also needs a Slurm executor with its account, image and job
  dir (``executors.check_submission``), and a Slurm run an absolute ``output_dir`` (a relative
  one would resolve against each node's working directory, and a requeued job would not find
  its checkpoints);
- a dry run prints the resolved configuration (YAML, every field); ``--save-config PATH`` also
  writes it to PATH, and ``config=PATH`` launches from such a file (overrides apply on top).
  (NeMo-Run's own ``--to-yaml`` is left as it is: it writes the task, recipe name and overrides.)
- the code a Slurm job runs is ``git archive`` of the checkout's HEAD (`executors.code_root`,
  whatever the working directory): uncommitted changes are refused by name, or shipped with
  ``--include-uncommitted``;
- ``--emit-sbatch PATH`` writes a plain sbatch + torchrun script of the job (checked like a
  submission; for clusters without NeMo-Run or containers) instead of submitting;
- ``-y`` is ``--yes`` (NeMo-Run gives it to both ``--yes`` and ``--yaml``; ``--yes`` wins there too).
"""

import ast
import dataclasses
import os
import runpy
import shutil
import sys
import time
import warnings
from typing import List, Optional

# leptonai 0.27 (imported by nemo_run) imports fastapi's WSGI middleware, which starlette >= 1.0
# deprecates with a warning on every start
warnings.filterwarnings("ignore", message=".*starlette.middleware.wsgi is deprecated")

import fiddle as fdl  # noqa: E402
import typer  # noqa: E402

import nemo_run as run  # noqa: E402
from nemo_run.cli import api as cli_api  # noqa: E402
from nemo_run.cli.cli_parser import parse_cli_args  # noqa: E402
from nemo_run.config import get_nemorun_home  # noqa: E402
from torchx.specs import AppState  # noqa: E402

from stapo_megatron.config.yaml_io import dump_config  # noqa: E402
from stapo_megatron.launch import entry, executors  # noqa: E402
from stapo_megatron.launch.arguments import (ADDED_OPTIONS, split_env_args, split_executor_args, split_flag,  # noqa: E402
                                             split_save_config, usage)

FAILED_STATES = (AppState.FAILED, AppState.CANCELLED, AppState.UNKNOWN)
"""Job states after a run that make the exit code non-zero (UNKNOWN: the state was lost)."""

USAGE = __doc__.split("\n\n")[0]

def _calls_nemo_run_main(path: str) -> bool:
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


def load_entrypoint(path: str) -> "cli_api.Entrypoint":
    """The entrypoint a launch file registers, without running it.

    The file runs as ``__main__`` with ``LAZY_CLI=true``: NeMo-Run's ``run.cli.main`` then only
    records its entrypoint (with the default executor / factory / plugins it was given) in
    ``nemo_run.cli.api.MAIN_ENTRYPOINT``; NeMo-Run's own script loader works the same way.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"launch file {path} does not exist")
    if not _calls_nemo_run_main(path):
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


class CheckedRunContext(cli_api.RunContext):
    """NeMo-Run's RunContext with the additions listed in the module docstring."""

    save_config: Optional[str] = None
    """Where ``--save-config`` writes the resolved configuration (set by `main`)."""

    emit_sbatch: Optional[str] = None
    """Where ``--emit-sbatch`` writes a plain sbatch + torchrun script (set by `main`)."""

    include_uncommitted: bool = False
    """``--include-uncommitted``: ship the checkout's working tree, not its HEAD (set by `main`)."""

    code_dir: Optional[str] = None
    """The checkout a Slurm job's code comes from (set by `_code`); NeMo-Run's Slurm packaging
    runs ``git rev-parse`` in the working directory, so the launch runs there after the checks."""

    def parse_args(self, args: List[str], lazy: bool = False):
        env, args = split_env_args(args)
        name, fields, others = split_executor_args(args)
        default = getattr(self, "executor", None)
        if name is None and fields and default is not None:
            config = default.to_config() if isinstance(default, run.Executor) else default
            self.executor = parse_cli_args(config, fields)
            args = others
        remaining = super().parse_args(args, lazy)
        if env:
            if self.executor is None:
                raise ValueError("run.executor.env_vars needs an executor")
            self.executor.env_vars = {**self.executor.env_vars, **env}
        return remaining

    def parse_fn(self, fn, args: List[str], **default_kwargs):
        task = super().parse_fn(fn, args, **default_kwargs)
        self.task = task
        self._preflight(task)
        return task

    def _preflight(self, task) -> None:
        """Fail before submitting or rendering: the task's recipe must build with its overrides
        (``entry.build_config``, the one override parser; a dry run does not require the paths a
        user fills in later), and a real submission needs a complete Slurm executor (a dry run
        shows the missing settings as ``<unset:...>`` instead)."""
        problems = []
        submitting = not self.dryrun or bool(self.emit_sbatch)
        if self.executor is not None and not self.dryrun:
            problems += executors.unset_settings(self.executor)
        if self.emit_sbatch and (not isinstance(self.executor, run.SlurmExecutor)
                                 or getattr(task, "__fn_or_cls__", None) is not entry.run_recipe):
            raise cli_api.RunContextError("--emit-sbatch writes the sbatch script of a recipe on a Slurm executor "
                                          "(launch/stapo_14b.py, stapo_8b.py, stapo_1p7b.py)")
        if getattr(task, "__fn_or_cls__", None) is entry.run_recipe:
            executor = self.executor
            if (isinstance(executor, run.SlurmExecutor) and task.recipe not in entry.TINY and not task.output_dir
                    and not task.config):
                # rendered with a visible placeholder; a submission refuses it (`_resolved`)
                task.output_dir = OUTPUT_DIR_PLACEHOLDER
            kwargs = dict(fdl.build(task).keywords)
            if isinstance(executor, run.SlurmExecutor):
                kwargs.update(num_nodes=executor.nodes, gpus_per_node=executor.gpus_per_node)
            elif isinstance(executor, run.LocalExecutor):
                kwargs.update(num_nodes=executor.nodes, gpus_per_node=executor.ntasks_per_node)
            try:
                cfg, warmstart = entry.build_config(check_paths=submitting, **kwargs)
            except ValueError as e:
                problems.append(str(e))
            else:
                problems += self._resolved(cfg, warmstart, kwargs["recipe"], executor)
                problems += self._paths(cfg, kwargs.get("config"), executor, kwargs["recipe"])
        if not self.emit_sbatch:
            problems += self._code(self.executor)
        if problems:
            raise cli_api.RunContextError(("no script written" if self.emit_sbatch else "not launched")
                                          + ":\n- " + "\n- ".join(problems))
        if self.code_dir:
            os.chdir(self.code_dir)

    def _code(self, executor) -> List[str]:
        """The checkout whose ``git archive`` a Slurm job runs: found wherever nemo-run runs; its
        uncommitted changes refused by name, or shipped with ``--include-uncommitted`` (the
        archive is then made of `executors.snapshot_commit`)."""
        packager = getattr(executor, "packager", None)
        if not isinstance(executor, run.SlurmExecutor) or not isinstance(packager, run.GitArchivePackager):
            return []
        root = packager.basepath or executors.code_root()
        if not root:
            return ["the job's code is shipped with git archive, but this package is not in a git checkout: "
                    "launch from a clone (pip install -e .), or set STAPO_CODE_DIR to one"]
        packager.basepath = self.code_dir = root
        changes = executors.uncommitted_files(root)
        if changes and self.include_uncommitted:
            packager.ref = executors.snapshot_commit(root)
            print(f"# ---- code: the working tree of {root} ({len(changes)} uncommitted changes included; "
                  f"commit {packager.ref[:12]} on HEAD) ----", flush=True)
            return []
        if changes:
            shown = "; ".join(line.strip() for line in changes[:20]) + ("; ..." if len(changes) > 20 else "")
            return self._refuse_or_show([
                f"{len(changes)} uncommitted changes in {root} would not reach the job (it runs git archive of "
                f"HEAD): {shown}. Commit them, or add --include-uncommitted to ship the working tree"])
        return []

    def _resolved(self, cfg, warmstart, recipe: str, executor) -> List[str]:
        """Show / write the resolved configuration; the problems a cluster run would have with it."""
        text = dump_config(cfg, warmstart, recipe)
        if self.dryrun and not self.emit_sbatch:
            print(f"# ---- resolved configuration (dry run) ----\n{text}", flush=True)
        if self.save_config:
            with open(self.save_config, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote the resolved configuration to {self.save_config} (launch it with config={self.save_config})")
        problems = []
        if isinstance(executor, run.SlurmExecutor) and cfg.run_dir == OUTPUT_DIR_PLACEHOLDER:
            problems.append("output_dir is not set: give an absolute path on a shared file system "
                            "(output_dir=/shared/path/run)")
        elif isinstance(executor, run.SlurmExecutor) and not os.path.isabs(cfg.run_dir):
            problems.append(f"output_dir {cfg.run_dir!r} is relative: a Slurm job needs an absolute path on a shared "
                            "file system (set output_dir=/shared/path/run; each node and each requeued job resolve "
                            "a relative one against their own working directory)")
        if isinstance(executor, run.SlurmExecutor) and recipe not in entry.TINY:
            problems += _step_time_report(cfg, recipe, executor)
        return self._refuse_or_show(problems)

    def _paths(self, cfg, config_file: Optional[str], executor, recipe: str) -> List[str]:
        """The login-node check of every path the job reads (`stapo_megatron.launch.paths`); the
        tiny recipe's model folder is not read but written, by the job (`entry.run_recipe`)."""
        from stapo_megatron.launch import paths

        slurm = isinstance(executor, run.SlurmExecutor)
        read = [(setting, path) for setting, path in paths.paths_read(cfg, config_file)
                if not (recipe in entry.TINY and setting == "model.hf_dir")]
        problems = paths.path_problems(
            read, dict(getattr(executor, "env_vars", None) or {}),
            getattr(executor, "container_mounts", None) or [] if slurm else [], needs_absolute=slurm)
        return self._refuse_or_show(problems)

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
        root = executors.code_root()
        if not root:
            raise cli_api.RunContextError("--emit-sbatch: this package is not in a checkout the nodes can run "
                                          "(set STAPO_CODE_DIR to the clone with its .venv)")
        script = executors.plain_sbatch_script(self.executor, kwargs["recipe"], entry.format_arguments(kwargs),
                                               root, self.name)
        with open(self.emit_sbatch, "w", encoding="utf-8") as f:
            f.write(script)
        os.chmod(self.emit_sbatch, 0o755)
        print(f"wrote {self.emit_sbatch}: submit it with `sbatch {self.emit_sbatch}` (plain sbatch + torchrun, "
              f"the code and .venv of {root})", flush=True)


OUTPUT_DIR_PLACEHOLDER = "<unset:output_dir>"
"""The run folder of a paper recipe on Slurm until ``output_dir=/shared/path`` is given (a dry run
shows it in the job; a submission is refused)."""


def _step_time_report(cfg, recipe: str, executor) -> List[str]:
    """Print the recipe's estimated step time and what it means at the executor's time limit;
    the problems a submission would have (a save signal shorter than a step, too few requeues)."""
    from stapo_megatron.recipes import memory, paper, step_time

    layout = dataclasses.replace(paper.layout_for(recipe, cfg), num_nodes=executor.nodes,
                                 gpus_per_node=executor.gpus_per_node)
    step = step_time.estimate_step_time(paper.ARCHITECTURES[recipe], layout, cfg)
    signal_s = int(str(executor.signal or "USR1@0").rpartition("@")[2])
    limit_s = step_time.parse_slurm_time(executor.time)
    print(f"# ---- layout and memory per GPU (recipes/memory.py: an estimate) ----\n"
          f"# {memory.describe(paper.ARCHITECTURES[recipe], layout)}\n"
          f"# ---- time (an estimate, recipes/step_time.py: not measured) ----\n"
          f"# one step ~{step.total_s / 60:.1f} min (rollout {step.rollout_s / 60:.1f}, training "
          f"{step.training_s / 60:.1f}); {cfg.steps} steps ~{cfg.steps * step.total_s / 3600:.0f} h of "
          f"{layout.world_size} GPUs", flush=True)
    problems = []
    if signal_s < step.total_s + step_time.SAVE_S:
        problems.append(f"the save signal {signal_s} s before the time limit is shorter than one step plus a save "
                        f"(~{step.total_s + step_time.SAVE_S:.0f} s): raise STAPO_SLURM_SIGNAL_S or "
                        "run.executor.signal=USR1@SECONDS")
        return problems
    try:
        jobs = step_time.jobs_needed(cfg.steps, step, limit_s, signal_s)
    except ValueError as e:
        return [str(e)]
    print(f"# time limit {executor.time}, save signal {signal_s} s before it: ~{jobs} jobs; "
          f"retries={executor.retries} (requeues for the time limit and for failures)", flush=True)
    if executor.retries < jobs - 1:
        problems.append(f"retries={executor.retries} cannot finish {cfg.steps} steps: at ~{step.total_s / 60:.1f} "
                        f"min a step they need ~{jobs} jobs of {executor.time}; set STAPO_SLURM_RETRIES or "
                        f"run.executor.retries to at least {jobs - 1} (plus some for failures)")
    return problems


def render_dryrun(task, executor, name: str) -> None:
    """Print what a launch would submit: NeMo-Run's dry-run log (the torchrun command of a
    local job) or, for Slurm, the sbatch script itself, unwrapped. Nothing is contacted: the
    experiment folder is prepared locally and removed again."""
    is_slurm = isinstance(executor, run.SlurmExecutor)
    with run.Experiment(title=name, executor=executor, enable_goodbye_message=False) as experiment:
        experiment.add(task, name=name)
        experiment.dryrun(log=not is_slurm, delete_exp_dir=False)
        folders = set()
        for job in experiment.jobs:
            folders.add(job.executor.experiment_dir)
            if isinstance(job.executor, run.SlurmExecutor):
                path = os.path.join(job.executor.experiment_dir, f"{job.executor.job_name}_sbatch.sh")
                with open(path) as f:
                    print(f"# ---- sbatch script of task {job.id} (dry run; submitted with "
                          f"sbatch --requeue --parsable) ----\n{f.read()}", flush=True)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _new_experiment_ids(started_ns: int) -> List[str]:
    """Experiments created under NEMORUN_HOME since ``started_ns`` (ids end in time_ns())."""
    root = os.path.join(get_nemorun_home(), "experiments")
    ids = []
    for title in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for exp_id in sorted(os.listdir(os.path.join(root, title))):
            stamp = exp_id.rpartition("_")[2]
            if stamp.isdigit() and int(stamp) >= started_ns:
                ids.append(exp_id)
    return ids


def _log_files(directory: str) -> List[str]:
    """A local job's logs: torchx's combined stdout+stderr per role replica if present."""
    found = []
    for dirpath, _, files in os.walk(directory):
        found += [os.path.join(dirpath, f) for f in files if f.endswith((".log", ".out"))]
    combined = [f for f in found if os.path.basename(f) == "combined.log"]
    return sorted(combined or found)


def failed_jobs(started_ns: int) -> List[str]:
    """One message per job of the experiments this command started that did not succeed."""
    failures = []
    for exp_id in _new_experiment_ids(started_ns):
        experiment = run.Experiment.from_id(exp_id)
        for name, job in (experiment.status(return_dict=True) or {}).items():
            if job["status"] in FAILED_STATES:
                where = job.get("remote_dir") or job["local_dir"]
                logs = _log_files(job["local_dir"]) if not job.get("remote_dir") else []
                failures.append(
                    f"task {name} of experiment {exp_id} ended {job['status'].name}; "
                    f"logs: {', '.join(logs) or where}"
                )
    return failures


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
