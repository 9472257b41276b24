"""What every benchmark in tools/ shares: CPU pressure readings and rounds that are taken
again when the machine was busy.

A ratio against PyTorch means nothing when other jobs share the cores: PyTorch's OpenMP
threads collapse first (one busy run measured 1135 ms for a step of 130 ms). So each round of
measurements reads ``/proc/pressure/cpu`` ("some" avg10: the share of the last 10 s in which
a runnable task waited for a CPU) and the load average before and after; a round with more
than ``MAX_PRESSURE`` percent is reported, dropped and taken again (up to ``retries`` times;
then kept, flagged).
"""

from __future__ import annotations

import os
import time

MAX_PRESSURE = 10.0  # percent, "some" avg10


def pressure_line() -> str:
    """The first line of ``/proc/pressure/cpu`` ("some avg10=... avg60=... avg300=... total=..."),
    "unavailable" where the kernel has no PSI."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return "unavailable"


def avg10(line: str) -> float:
    """The "some" avg10 of a :func:`pressure_line` in percent (nan where it has none)."""
    for field in line.split():
        if field.startswith("avg10="):
            return float(field[len("avg10="):])
    return float("nan")


def pressure() -> float:
    """``/proc/pressure/cpu`` "some" avg10 in percent (nan where the kernel has no PSI)."""
    return avg10(pressure_line())


def reading() -> str:
    """Pressure and load average, for printing beside the figures."""
    return f"cpu pressure {pressure():.2f}%, load {os.getloadavg()[0]:.2f}"


def round_line(label: str, before: float, after: float) -> str:
    """The line printed after each measured round: ``label`` and the pressure read before and
    after it (what :func:`measured_round` returns)."""
    return f"  {label} cpu pressure {before:.2f}% -> {after:.2f}%"


def calm(max_pressure: float = MAX_PRESSURE, wait_s: float = 30.0) -> None:
    """Wait (up to ``wait_s``) until the pressure of the last 10 s is below ``max_pressure``."""
    end = time.monotonic() + wait_s
    while pressure() > max_pressure and time.monotonic() < end:
        time.sleep(1.0)


def measured_round(run, label: str, retries: int = 2, max_pressure: float = MAX_PRESSURE, log=print):
    """``run()`` (one round of measurements, returning them) taken again while the pressure read
    after it is above ``max_pressure``; returns (its result, the pressure before, after)."""
    for attempt in range(retries + 1):
        calm(max_pressure)
        before = pressure()
        result = run()
        after = pressure()
        if not after > max_pressure:
            return result, before, after
        log(f"  {label}: taken under cpu pressure {before:.1f}% -> {after:.1f}% (> {max_pressure:g}%): "
            + ("dropped, taken again" if attempt < retries else "kept, FLAGGED"))
    return result, before, after
