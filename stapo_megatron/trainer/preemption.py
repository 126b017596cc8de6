"""Save and stop when the scheduler warns: Slurm's ``--signal=USR1@<seconds>`` before the time limit.

The path of the warning on a Slurm job (``stapo_megatron/launch/executors.py`` sets it up):

    sbatch --signal=USR1@S --requeue     Slurm signals the job step S seconds before the limit
    torchrun                             handles SIGUSR1 (`torchrun_env`), forwards it to its
                                         workers and waits for them up to the grace period
    each worker: `SaveOnSignal`          records the signal; at the next step boundary every rank
                                         agrees (a MAX all-reduce), the step is saved, training stops
    exit code `REQUEUE_EXIT_CODE`        non-zero, so NeMo-Run's sbatch script requeues the job
                                         (``executor.retries``) and the new job resumes from the save

The handler itself only sets a flag: a save needs every rank at the same point, which only the
training loop knows.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Dict, Sequence

import torch
import torch.distributed as dist

from stapo_megatron.utils import collective_device

REQUEUE_EXIT_CODE = os.EX_TEMPFAIL
"""Exit code of a worker that saved and stopped on the warning signal (75: "try again later")."""
DEFAULT_SIGNALS = (signal.SIGUSR1,)
"""The signals that ask for a save-and-stop (Slurm's ``--signal`` sends SIGUSR1 here)."""

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""torchrun's handled signals (its default set plus SIGUSR1): without SIGUSR1 here, the warning
would kill torchrun itself (SIGUSR1's default action) and with it the job step."""


def torchrun_env(grace_s: int) -> Dict[str, str]:
    """The environment that makes torchrun forward the warning signal to its ranks and give them
    ``grace_s`` seconds to save before it kills them.

    torchrun reads ``--signals-to-handle`` / ``--shutdown-timeout`` from ``PET_*`` variables
    (torch 2.13 run.py: its argument default overwrites ``TORCHELASTIC_SIGNALS_TO_HANDLE``, which
    earlier torch versions read directly, so both are set).
    """
    grace = str(int(grace_s))
    return {"PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS, "TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS,
            "PET_SHUTDOWN_TIMEOUT": grace, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": grace}


class StoppedForRequeue(SystemExit):
    """Raised by `stapo_megatron.trainer.loop.train` after a save on the warning signal: the process
    exits with `REQUEUE_EXIT_CODE` (no traceback), the scheduler requeues, the next job resumes."""

    def __init__(self, step: int):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step = step


class SaveOnSignal:
    """Records the warning signal; `stop_now` at a step boundary says whether to save and stop.

    `install` / `uninstall` (or use it as a context manager) replace and restore the handlers.
    """

    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.received: bool = False
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = True

    def install(self) -> "SaveOnSignal":
        """Install the handlers (main thread only: Python runs handlers there); returns self."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers `install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    __enter__ = install

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def any_rank_received(self) -> bool:
        """Collective over all ranks: whether any rank got the signal (each rank may see it at a
        different moment; all must stop at the same step)."""
        if not dist.is_initialized():
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop_now(self, saved: bool, save: Callable[[], None]) -> bool:
        """Collective, at a step boundary: if any rank got the signal, ``save()`` the step unless
        it is ``saved`` already, and return True (the caller stops); else False."""
        if not self.any_rank_received():
            return False
        if not saved:
            save()
        return True
