"""stapo-doctor: run each GPU component of the project in isolation and print one row per check.

    stapo-doctor                      # every check that applies to this machine; the rest skipped
    stapo-doctor --json               # the rows as JSON (stdout)
    stapo-doctor --only vllm stapo_steps
    stapo-doctor --skip stapo_steps --moe
    nemo-run launch/doctor.py ...     # on one or two Slurm nodes (NCCL between them)

Exit code 0 when no check failed (skips are not failures), 1 otherwise, 2 on bad arguments. Under
torchrun with several ranks (``launch/doctor.py``) every rank joins the collectives row over the
whole job; rank 0 then runs the other checks alone and prints the report. (No ``from __future__
import annotations``: NeMo-Run parses `run_from_launch`'s arguments with its real annotations.)
"""

import argparse
import contextlib
import datetime
import os
import sys
import warnings
from typing import Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from stapo_megatron.doctor import report
from stapo_megatron.doctor.report import Check

CHECKS = ("versions", "collectives", "logprob_op", "attention", "delta_net", "te_spec", "vllm", "engine_start",
          "stapo_steps")
"""The check names ``--only`` and ``--skip`` take (``vllm`` is the engine's rows together)."""


@contextlib.contextmanager
def one_rank_megatron() -> Iterator:
    """This process as a one-rank Megatron job (a store in memory, no address or port), for the
    in-process checks; yields its `Groups` and tears the parallel state down afterwards."""
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))
    try:
        yield init_parallel(1, 1)
    finally:
        destroy_parallel()


def device_name() -> str:
    """What the checks run on: ``torch.cuda.get_device_name()`` of this process's current GPU, or
    ``cpu`` without CUDA (the report's first line, and ``device`` in ``--json``)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_local(names: Sequence[str], moe: bool = False) -> List[Check]:
    """The chosen checks on this machine alone, in `CHECKS` order."""
    from stapo_megatron.doctor import collectives, engine, kernels, steps, versions

    rows: List[Check] = []
    if "versions" in names:
        rows.append(report.run_check("versions", versions.check_versions))
    if "collectives" in names:
        rows.append(report.run_check("collectives", collectives.check_collectives))
    in_process = [n for n in ("logprob_op", "attention", "delta_net", "te_spec", "vllm") if n in names]
    if in_process:
        with one_rank_megatron() as groups:
            if "logprob_op" in names:
                rows.append(report.run_check("logprob_op", kernels.check_logprob_op))
            if "attention" in names:
                rows.append(report.run_check("attention", kernels.check_attention))
            if "delta_net" in names:  # Qwen3.5's delta-net kernels (fla on CUDA, the torch kernel on the CPU)
                rows.append(report.run_check("delta_net", kernels.check_delta_net))
            if "te_spec" in names:
                for variant in ("qwen3", "qwen3-moe") if moe else ("qwen3",):
                    rows.append(report.run_check(f"te_spec_{variant}", lambda v=variant: kernels.check_te_spec(v)))
            if "vllm" in names:
                rows += engine.engine_checks(groups, moe=moe)
    if "engine_start" in names:
        rows.append(report.run_check("engine_start", engine.check_engine_start))
    if "stapo_steps" in names:
        rows.append(report.run_check("stapo_steps", steps.check_stapo_steps))
    return rows


def run_job(names: Sequence[str], moe: bool = False) -> Optional[List[Check]]:
    """Under torchrun with several ranks: the collectives over the whole job on every rank, then
    the other checks on rank 0 alone (the other ranks return None)."""
    from stapo_megatron.doctor import collectives
    from stapo_megatron.mcore.parallel import init_process_group

    init_process_group()
    rows = []
    if "collectives" in names:
        backend = dist.get_backend()
        device = torch.cuda.get_device_name() if backend == "nccl" else "cpu"

        def measured() -> Check:
            result = collectives.measure()
            # more NCCL ranks than this node's GPUs: the job spans nodes (no NVLink bound then)
            result["multi_node"] = backend == "nccl" and dist.get_world_size() > torch.cuda.device_count()
            return collectives.row(result, backend, device)

        rows.append(report.run_check("collectives", measured))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return rows + run_local([n for n in names if n != "collectives"], moe)


def run_doctor(only: Optional[List[str]] = None, skip: Optional[List[str]] = None, moe: bool = False,
               as_json: bool = False, world_size: int = 1) -> int:
    """Run the checks and print the report (rank 0); returns the exit code. ``world_size`` > 1:
    this process is one rank of a torchrun job (`run_job`). The entry of ``launch/doctor.py``."""
    names = report.select(CHECKS, only, skip)
    # with --json, stdout carries the JSON alone: what the checks print goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with warnings.catch_warnings(), quiet:
        # megatron-core warns about absent transformer-engine/apex on every CPU import
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        rows = run_job(names, moe) if world_size > 1 else run_local(names, moe)
    if rows is None:
        return 0
    device = device_name()
    print(report.to_json(rows, dict(device=device)) if as_json else report.format_table(rows, device), flush=True)
    return report.exit_code(rows)


def run_from_launch(only: str = "", skip: str = "", moe: bool = False, as_json: bool = False) -> None:
    """`run_doctor` in each process of a launched job (``launch/doctor.py``): ``only`` and
    ``skip`` are comma-separated check names (``skip=stapo_steps,te_spec``); a failed check ends
    the job with exit code 1."""
    split = lambda text: [n for n in text.split(",") if n] or None  # noqa: E731
    # torchrun's topology, not configuration: how many ranks this job has
    code = run_doctor(split(only), split(skip), moe, as_json, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if code:
        raise SystemExit(code)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stapo-doctor", description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", metavar="CHECK", help=f"run only these checks: {', '.join(CHECKS)}")
    p.add_argument("--skip", nargs="+", metavar="CHECK", help="skip these checks")
    p.add_argument("--moe", action="store_true",
                   help="also check a mixture-of-experts model (vLLM's routed experts, TE's grouped experts)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    # torchrun's topology, not configuration: several ranks make this process one of a job
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return run_doctor(args.only, args.skip, args.moe, args.json, world_size)
    except ValueError as e:
        print(f"stapo-doctor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
