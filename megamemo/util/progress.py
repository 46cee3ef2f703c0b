"""Progress of a long command: a tqdm bar on a terminal, plain periodic lines otherwise (logs, pipes, Slurm).

    from megamemo.util.progress import Progress

    with Progress("[eval]", total=n_segments, unit="segment", every=10.0, log=print,
                  line=lambda p: f"[eval] segment {p.n}/{p.total}: {p.info['tokens']:,} tokens") as p:
        for ...:
            p.update(1, tokens=count, nll=lambda: float(total) / count)   # callables: evaluated only when drawn

Progress(desc, total=None, *, unit="it", every=10.0, line=None, log=None, bar=None, stream=None, scale=False,
         postfix=None, clock=time.monotonic)
  desc     the bar's label; also the default plain line's start
  total    the end of the count (None or 0: unknown; the bar then shows no percentage)
  unit     the count's unit
  scale    the bar shows the count with SI prefixes (k, M, G: powers of 1000)
  every    seconds between plain lines (the first comes `every` seconds after the start)
  line     p -> str: the plain line (default: "desc: n/total unit (pct), rate unit/s")
  log      where plain lines go (default: print to stream)
  bar      True: tqdm bar; False: plain lines; None (default): a bar when stream.isatty()
  stream   the bar's stream (default sys.stderr)
  postfix  info -> str: the text after the bar (default "key=value, ...": floats to 4 significant digits,
           integers with thousands separators)
Methods: update(n=1, **info) advances by n; update_to(n, **info) sets the position; close() (also on leaving
`with`) ends the bar. Attributes for `line`: n, total, unit, elapsed (s), rate (units/s), info (the latest
keyword fields, callables already evaluated). The caller prints its own summary after close().
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

BAR_REDRAW_S = 0.5  # the bar's postfix (and its lazy fields) is refreshed at most this often


class Progress:
    def __init__(
        self,
        desc: str,
        total: float | None = None,
        *,
        unit: str = "it",
        every: float = 10.0,
        line: Callable[[Progress], str] | None = None,
        log: Callable[[str], None] | None = None,
        bar: bool | None = None,
        stream=None,
        scale: bool = False,
        postfix: Callable[[dict], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.desc, self.total, self.unit, self.every = desc, (total or None), unit, every
        self.stream = sys.stderr if stream is None else stream
        self._line = line or _default_line
        self._log = log or (lambda m: print(m, file=self.stream, flush=True))
        self._postfix = postfix or _default_postfix
        self._clock = clock
        self.n: float = 0
        self.info: dict = {}
        self._raw: dict = {}
        self.t0 = self._last = clock()
        if bar is None:
            bar = _isatty(self.stream)
        self._bar = None
        if bar:
            from tqdm import tqdm  # only for a terminal; tqdm is no declared dependency (DeepSpeed brings it)

            cols, rows = _size(self.stream)  # a terminal that reports no size (a bare pty): 80 x 24
            self._bar = tqdm(
                total=self.total,
                desc=desc,
                unit=unit,
                file=self.stream,
                unit_scale=scale,
                dynamic_ncols=cols > 0,
                ncols=None if cols > 0 else 80,
                nrows=None if rows > 0 else 24,
                mininterval=BAR_REDRAW_S,
            )

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    @property
    def elapsed(self) -> float:
        return self._clock() - self.t0

    @property
    def rate(self) -> float:
        return self.n / max(self.elapsed, 1e-9)

    def update(self, n: float = 1, **info) -> None:
        self.update_to(self.n + n, **info)

    def update_to(self, n: float, **info) -> None:
        delta, self.n = n - self.n, n
        self._raw.update(info)
        now = self._clock()
        if self._bar is not None:
            if now - self._last >= BAR_REDRAW_S and self._raw:
                self._last = now
                self._bar.set_postfix_str(self._postfix(self._evaluate()), refresh=False)
            self._bar.update(delta)
        elif now - self._last >= self.every:
            self._last = now
            self._evaluate()
            self._log(self._line(self))

    def _evaluate(self) -> dict:
        self.info = {k: (v() if callable(v) else v) for k, v in self._raw.items()}
        return self.info

    def close(self) -> None:
        if self._bar is not None:
            if self._raw:
                self._bar.set_postfix_str(self._postfix(self._evaluate()), refresh=False)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _size(stream) -> tuple[int, int]:
    try:
        cols, rows = os.get_terminal_size(stream.fileno())
        return cols, rows
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
        return 0, 0


def _default_line(p: Progress) -> str:
    of = f"/{p.total:g}" if p.total else ""
    pct = f" ({100 * p.n / p.total:.0f}%)" if p.total else ""
    return f"{p.desc}: {p.n:g}{of} {p.unit}{pct}, {p.rate:,.1f} {p.unit}/s"


def _default_postfix(info: dict) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    return ", ".join(f"{k}={fmt(v)}" for k, v in info.items())
