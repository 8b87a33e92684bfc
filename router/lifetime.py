"""Child processes that end with the process that started them (Linux ``PR_SET_PDEATHSIG``).

The parent names itself in the child's environment (:func:`child_env`); the
child, first thing in its ``main``, asks the kernel for SIGTERM when that
parent goes (:func:`die_with_parent_if_asked`). If the parent went already,
before the request took effect, the child's parent is no longer the one named,
and it ends at once.

Nothing runs between fork and exec. A ``preexec_fn`` would: in a process with
gRPC's threads (the router starting its ``--processes`` children, ``slo-router
up`` starting its cluster) the child can deadlock there on a lock another
thread held at the fork, and then never execs. That left a ``--processes``
child silent until its start timed out.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping

#: The environment variable that carries the parent's pid to the child.
PARENT_PID_ENV = "SLO_ROUTER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) asking the child to end with this process."""
    env = dict(os.environ if base is None else base)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


def die_with_parent_if_asked() -> None:
    """When started through :func:`child_env`: SIGTERM to this process when its parent goes.

    The variable leaves the environment, so this process's own children do not
    inherit a request that names another process than their parent. Without it
    (a process the user started), nothing changes.
    """
    value = os.environ.pop(PARENT_PID_ENV, None)
    if value is None:
        return
    try:
        parent = int(value)
    except ValueError:
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it went before the request took effect: end as if told
        os.kill(os.getpid(), signal.SIGTERM)
