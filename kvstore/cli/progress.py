"""Progress reporting for long maintenance passes, on stderr only.

``ProgressBar`` is the ``progress(phase, done, total)`` callback that
``kvstore.maintenance.check`` (``check``, ``repair``) and ``kvstore.maintenance.gc`` (``run_gc``) calls. Contract:

* It writes to its stream (stderr) and nowhere else, so ``--json`` output on
  stdout stays parseable.
* On a TTY it redraws one line with ``\\r`` (at most every ``interval_s``,
  always on the last step of a phase); ``close()`` ends the line.
* Elsewhere (a pipe, a log file, CI) it writes a plain line when a phase
  starts, at most every ``log_interval_s`` after that, and when it finishes.
* It never raises into the pass it reports on: a write error is swallowed.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class ProgressBar:
    """A hand-written ``\\r`` bar on a TTY, periodic log lines otherwise."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, width: int = 30,
                 interval_s: float = 0.1, log_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "kvtool"):
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.width = width
        self.interval_s = interval_s if tty else log_interval_s
        self.clock = clock
        self.prefix = prefix
        self._phase: str | None = None
        self._last = float("-inf")
        self._line_open = False
        self._finished = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        new_phase = phase != self._phase
        if new_phase:
            self._end_line()
            self._phase, self._finished = phase, False
        final = total > 0 and done >= total
        if final and self._finished:
            return  # the same "done" reported twice: one line is enough
        if not (new_phase or final or now - self._last >= self.interval_s):
            return
        self._last = now
        self._finished = final
        self._write(self._render(phase, done, total))

    def _render(self, phase: str, done: int, total: int) -> str:
        if total <= 0:
            return f"{self.prefix}: {phase}: nothing to do"
        frac = min(1.0, max(0.0, done / total))
        if not self.tty:
            return f"{self.prefix}: {phase}: {done}/{total} ({frac:.0%})"
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.prefix}: {phase:<8} [{bar}] {done}/{total} {frac:4.0%}"

    def _write(self, text: str) -> None:
        try:
            if self.tty:
                self.stream.write("\r\x1b[2K" + text)
                self._line_open = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must not fail the maintenance pass

    def _end_line(self) -> None:
        if self._line_open:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self._line_open = False

    def close(self) -> None:
        """End the TTY line, if one is drawn (idempotent)."""
        self._end_line()
