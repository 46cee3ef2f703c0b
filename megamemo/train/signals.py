"""SIGUSR1 / SIGTERM: ask the loop to finish the current step, save a checkpoint and exit 0.

The handler only records the signal. Ranks can receive it at different steps (or only one of them, e.g. a
`kill -USR1` to one process), so the loop all-reduces the flag with the step's loss and all ranks stop after the
same step.
"""
from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self, signals=STOP_SIGNALS):
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.signum is None:
            print(f"[signal] received {signal.Signals(signum).name}: finishing the step, then saving and exiting",
                  flush=True)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
