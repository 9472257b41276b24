"""This process's resident memory and its peak (Linux's /proc), for the memory tests and benchmarks."""

from __future__ import annotations


def resident_bytes(key: str = "VmRSS") -> int:
    """This process's resident size (``VmRSS``) or its peak since the last :func:`reset_peak`
    (``VmHWM``), from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Make the peak resident size (``VmHWM``) the present one (Linux's /proc/self/clear_refs)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
