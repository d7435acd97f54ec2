"""The cores this process may use: a worker count's and a thread pool's default."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its affinity, as a container's
    cpuset sets it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
