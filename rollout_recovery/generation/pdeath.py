"""Make vLLM's EngineCore process die with the process that started it.

vLLM sets no parent-death signal on the EngineCore. Ray's default cleanups kill it when the
actor dies, but with those cleanups off (or a Ray that changes them) a SIGKILLed actor would
leave an orphaned engine holding memory. Spawn pickles the process target by reference, so
replacing `EngineCoreProc.run_engine_core` with this module-level wrapper makes the child run it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


def _run_engine_core_with_pdeathsig(*args, **kwargs):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    # The parent may have died between fork and prctl; then nobody would signal us.
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
    from vllm.v1.engine.core import EngineCoreProc

    # In the spawned child nothing is patched, so this is vLLM's own function.
    target = getattr(EngineCoreProc, "_rr_original_run_engine_core", EngineCoreProc.run_engine_core)
    return target(*args, **kwargs)


def install() -> None:
    """Patch EngineCoreProc before an AsyncLLM is created. Idempotent; Linux only."""
    if not os.path.exists("/proc/self"):
        return
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, "_rr_original_run_engine_core", None) is not None:
        return
    EngineCoreProc._rr_original_run_engine_core = staticmethod(EngineCoreProc.run_engine_core)
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core_with_pdeathsig)
