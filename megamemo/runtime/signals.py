"""Stop signals (SIGUSR1, SIGTERM, SIGHUP, SIGINT): ask the loop to finish the current step, save a checkpoint
and exit 0.

A worker blocks them first thing (`hold`, called by the `megamemo` command before any import of torch), so a
signal that arrives during start-up (Slurm's `--signal` reaches every process of the step, whenever it fires) stays
pending instead of killing the process; `StopRequest` installs the handler and unblocks them, and the pending one
is then handled like any other: the run stops after its first step, saving.

The handler only records the signal. Ranks can receive it at different steps (or only one of them, e.g. a
`kill -USR1` to one process), so the loop all-reduces the flag with the step's loss and all ranks stop after the
same step. A second SIGINT (Ctrl-C twice on a process run without the launcher) raises KeyboardInterrupt.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def hold(signals=STOP_SIGNALS) -> None:
    """Block the stop signals in this process (and the threads it starts from now on) until StopRequest takes them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)


class StopRequest:
    def __init__(self, signals=STOP_SIGNALS):
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # one held since start-up is handled now

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signum is None:
            print(
                f"[signal] received {signal.Signals(signum).name}: finishing the step, then saving and exiting",
                flush=True,
            )
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
