"""Killing a whole process tree at once, the way losing a machine would."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> set[int]:
    """SIGKILL a process and all its descendants at once, as losing the machine would; returns
    their pids. torchrun starts its workers in sessions of their own, so killing the process
    group is not enough; the tree is frozen with SIGSTOP first so nothing escapes by being
    reparented."""
    frozen: set[int] = set()
    while True:
        tree = {pid, *descendants(pid)} - frozen
        if not tree:
            break
        for member in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGSTOP)
        frozen |= tree
    for member in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    return frozen
