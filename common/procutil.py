"""Process helpers shared by the runner's probe workers and the sweep's pool workers."""
from __future__ import annotations

import os
import signal


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, so a killed command leaves no orphan
    appending rows or burning cores (PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
