"""Progress of a long export on stderr: each phase prints when it starts and
ends with the elapsed time, counts its real units (bytes copied, functions
rewritten, signatures verified) and, while one step takes long (the TFLite
converter on a GB table), prints a line every few seconds so the output moves."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Optional


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / 2 ** 20:.1f} MiB"
    return f"{int(n)} {unit}".rstrip()


class Phase:
    """One running phase; advance(n) counts finished units."""

    def __init__(self, progress: "Progress", text: str, total: Optional[float], unit: str):
        self.progress, self.text, self.total, self.unit = progress, text, total, unit
        self.done = 0.0
        self.start = time.monotonic()
        self._last_print = self.start
        self._lock = threading.Lock()

    def counted(self) -> str:
        if self.total is None:
            return ""
        return f" {_amount(self.done, self.unit)} / {_amount(self.total, self.unit)}"

    def advance(self, n: float = 1) -> None:
        """Counts n more units; prints the count at most once per interval
        (the final count goes on the phase's "done" line)."""
        with self._lock:
            self.done += n
            now = time.monotonic()
            finished = self.total is not None and self.done >= self.total
            if now - self._last_print >= self.progress.interval_s and not finished:
                self._last_print = now
                self.progress.emit(f"  {self.text}:{self.counted()}")

    def heartbeat(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last_print >= self.progress.heartbeat_s:
                self._last_print = now
                self.progress.emit(f"  {self.text}: still running, {now - self.start:.0f} s"
                                   f"{';' + self.counted() if self.total else ''}")


class Progress:
    """Phase lines `[  12.3s] text` on a stream; silent when quiet."""

    def __init__(self, quiet: bool = False, stream=None, interval_s: float = 1.0,
                 heartbeat_s: float = 5.0):
        self.quiet = quiet
        self.stream = stream
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.t0 = time.monotonic()

    def emit(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:7.1f}s] {text}",
                  file=self.stream or sys.stderr, flush=True)

    def note(self, text: str) -> None:
        self.emit(text)

    @contextlib.contextmanager
    def phase(self, text: str, total: Optional[float] = None, unit: str = ""):
        phase = Phase(self, text, total, unit)
        self.emit(text + (f" ({_amount(total, unit)})" if total is not None else "") + " ...")
        stop = threading.Event()

        def beat():
            while not stop.wait(min(1.0, self.heartbeat_s)):
                phase.heartbeat()
        thread = None
        if not self.quiet:
            thread = threading.Thread(target=beat, name="pkm-export-progress", daemon=True)
            thread.start()
        try:
            yield phase
        finally:
            stop.set()
            if thread is not None:
                thread.join()
        self.emit(f"{text}: done in {time.monotonic() - phase.start:.1f} s"
                  + (f" ({phase.counted().strip()})" if total is not None else ""))
