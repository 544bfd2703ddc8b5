"""What a process holds in memory, as the kernel counts it (Linux ``/proc``; 0 elsewhere).

``modeld status`` and ``/metrics`` split the daemon's and its engine workers' resident memory
into parts (blueprint 0016, "Accounting that adds up to RSS"): the measured figures come from
here. :func:`rss` is a process's resident set (``statm``, cheap); :func:`file_rss` is how much of
one file a process has resident through its mappings (``smaps``: a model's weights are a file
mapping, resident as far as the engine touched them and the kernel kept them).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["file_rss", "rss"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss(pid: int) -> int:
    """The resident set of process ``pid`` in bytes (0: gone, or not Linux)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * _PAGE


def file_rss(pid: int, path: str) -> int:
    """Bytes of the file at ``path`` resident in process ``pid``'s mappings of it (0: none, the
    process is gone, or not Linux). The path is resolved, as the kernel names mappings."""
    try:
        target = os.path.realpath(path)
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return 0
    total = 0
    inside = False
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's first line: address perms offset dev inode path
            fields = line.split(None, 5)
            inside = len(fields) == 6 and fields[5] == target
        elif inside and head == "Rss:":
            total += int(rest.split()[0]) * 1024
    return total
