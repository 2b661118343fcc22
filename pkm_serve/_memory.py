"""Process memory readings (Linux /proc) for the demo and the benchmarks."""

from __future__ import annotations

import contextlib


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A size field of /proc/<pid>/status (e.g. VmRSS, VmHWM), in bytes; this
    process by default. OSError if that process is gone."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/{pid}/status has no {field}")


def reset_peak_rss() -> None:
    """Resets the process's peak RSS (VmHWM) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextlib.contextmanager
def peak_rss_growth(result: dict, key: str):
    """Records in result[key] how much the peak RSS grows inside the block."""
    reset_peak_rss()
    base = status_bytes("VmRSS")
    yield
    result[key] = status_bytes("VmHWM") - base
