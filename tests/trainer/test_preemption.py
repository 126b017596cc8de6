"""The save on the scheduler's warning signal (Slurm ``--signal=USR1@S``), with a real SIGUSR1 sent
to a real torchrun job: torchrun forwards it to its ranks (the environment the Slurm executor
sets), the ranks save at the next step boundary and stop with `REQUEUE_EXIT_CODE`, and a new
launch resumes from that save. The test waits for the run to say it is ready (a file), never for
a wall-clock moment."""

import os
import signal

import pytest

from stapo_megatron.trainer.preemption import SaveOnSignal


def test_handler_records_the_signal_and_restores_the_previous_one():
    previous = signal.getsignal(signal.SIGUSR1)
    with SaveOnSignal() as stop:
        assert not stop.received
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill returns (to this thread)
        assert stop.received
        saves = []
        assert stop.stop_now(saved=False, save=lambda: saves.append(1)) and saves == [1]
        assert stop.stop_now(saved=True, save=lambda: saves.append(2)) and saves == [1]
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert not SaveOnSignal().stop_now(saved=False, save=lambda: pytest.fail("saved without a signal"))


