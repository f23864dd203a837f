"""The open-files limit of a serving process.

A worker holds a file descriptor per HTTP connection, per ZeroMQ socket, and, with the Mooncake
backend over TCP, per lane of its transfer engines: a prefill engine keeps up to
``MooncakeConfig.tcp_lanes`` connections (4 by default) to every decode rank it has written to
until the engine closes, also after that rank went away (the sockets wait in CLOSE-WAIT;
docs/operations.md, *Open files*). A prefill worker that outlives many decode workers needs
room for them, so ``pdlife serve`` raises its soft limit to the hard one at start-up, before
it starts its rank processes, which inherit the raised limit.
"""

from __future__ import annotations

import logging
import resource
from pathlib import Path

logger = logging.getLogger(__name__)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (to the kernel's ceiling,
    ``fs.nr_open``, where the hard limit is unlimited); the soft limit before and after (the
    same when it was already there or the system refused)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    target = hard if hard != resource.RLIM_INFINITY else _kernel_ceiling()
    if target <= soft:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target,
                       exc)
        return soft, soft
    logger.info("open-files limit raised from %d to %d", soft, target)
    return soft, target


def _kernel_ceiling() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20  # Linux's default fs.nr_open
