"""Starting or joining Ray, hosting a class as an actor, and a private event loop on a thread.

Each is the one way the project does it, so actor options (resources, the armed test fault)
and loop ownership are decided in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import ray

from rollout_recovery import components, faults
from rollout_recovery.errors import RecoveryError

T = TypeVar("T")


def init_ray(
    address: str = "local", num_cpus: int | None = None, log_to_driver: bool = True
) -> None:
    """Start a private local Ray (`address="local"`) or join a cluster (`"auto"` or an address).

    `local` never attaches to another process's cluster on the same machine by accident.
    """
    if ray.is_initialized():
        return
    kwargs: dict = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if address == "local" and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    with _sigterm_kept():
        ray.init(address=address, **kwargs)


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Ray's start replaces the SIGTERM handler (its Python one exits 15; one its core
    installs while starting aborts with a C++ stack): keep a Python handler the process had (a
    run's preemption watch, preemption.py), else put Ray's Python one in force after the start.

    Meanwhile a notice is held, then delivered to that handler once it is in place: SIGTERM is
    blocked in this (the main) thread and in the threads Ray starts, which inherit the block;
    a notice that a thread started before (a native one: jemalloc's, Arrow's) takes anyway
    reaches only a deferring Python handler, because `signal.signal` is wrapped for the start
    so Ray's Python handler is recorded, not installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before, real = signal.getsignal(signal.SIGTERM), signal.signal
    held: list[int] = []
    asked: list[Any] = []  # the SIGTERM handlers the start asked for, last one last

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    def recorded(signum: int, handler: Any) -> Any:
        if signum != signal.SIGTERM:
            return real(signum, handler)
        asked.append(handler)
        return hold

    real(signal.SIGTERM, hold)
    signal.signal = recorded
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.signal = real
        after = asked[-1] if asked else None
        keep = before if callable(before) else after if callable(after) else signal.SIG_DFL
        real(signal.SIGTERM, keep)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if held:
            signal.raise_signal(signal.SIGTERM)


def actor_class(cls: type, **options: Any) -> Any:
    """`cls` as a Ray actor class with `options`; an armed test fault (faults.py) is added to
    its runtime environment, so every actor of a faulted run sees the same faults."""
    fault_env = faults.actor_env_vars()
    if fault_env:
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = dict(runtime_env.get("env_vars") or {}) | fault_env
        options["runtime_env"] = runtime_env
    groups = options.pop("concurrency_groups", None)  # fixed with the class, not an option
    remote = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    return remote.options(**options)


class LoopThread:
    """An asyncio loop on its own daemon thread, for synchronous objects whose work is async.

    The caller's thread may already run a loop (a Ray actor's does), so the object owns a
    private one; it also owns the loop's resources (HTTP connection pools), which must be
    used from the loop that made them.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a synchronous step on the loop thread (for state only that thread may touch)."""

        async def step() -> T:
            return fn(*args)

        return self.run(step())

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)


def expected(err: BaseException) -> BaseException:
    """The expected failure (`RecoveryError`, `OSError`) a Ray task raised, when `err` is Ray's
    wrapper of one; else `err`. Raised as itself, its one-line message (and a `UserCodeError`'s
    frames of the user's code, carried as text) reaches the user without Ray's trace."""
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(
        err.cause, RecoveryError | OSError
    ):
        return err.cause
    return err


async def remote_result(ref: Any) -> Any:
    """Await a Ray call's result as `ActorProxy` waits for one: an expected failure raised in
    the actor is raised as itself."""
    try:
        return await ref
    except ray.exceptions.RayTaskError as err:
        cause = expected(err)
        if cause is err:
            raise
        raise cause from None


class ActorProxy:
    """A class hosted as a Ray actor and called like the in-process object: each method call
    waits for its result. An expected failure (`RecoveryError`, `OSError`) is raised as
    itself, so its one-line message reaches the user without Ray's trace; a dead actor of the
    job (this one, or one it was waiting on) as a `ComponentLost` naming it (components.py)."""

    def __init__(self, cls: type, args: tuple, start: str | None = None, **options: Any) -> None:
        self.actor = actor_class(cls, **options).remote(*args)
        self.pending: Any = None  # a `watched` call its probe left waiting (`settled`)
        if start is not None:  # a start method may return the object: do not ship it back
            self._result(self.actor.__ray_call__.remote(
                lambda obj: getattr(obj, start)() and None))  # fmt: skip

    @staticmethod
    def _result(ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
            cause = expected(err)
            if cause is not err:
                raise cause from None
            dead = components.lost(err)
            if dead is not None:
                raise dead from None
            raise

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.actor, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._result(method.remote(*args, **kwargs))

        return call

    def call_in(self, group: str, name: str, *args: Any, timeout: float | None = None) -> Any:
        """`name(*args)` in the actor's concurrency group `group`: it runs beside a call still
        holding the default group (one a signal interrupted in the caller)."""
        method = getattr(self.actor, name).options(concurrency_group=group)
        return self._result(method.remote(*args), timeout)

    def watched(self, name: str, args: tuple, probe: Callable[[], None], every_s: float) -> Any:
        """`name(*args)`, calling `probe()` every `every_s` while it waits: a probe that finds
        the call can no longer finish raises, and the call is left to the actor's end."""
        ref = self.pending = getattr(self.actor, name).remote(*args)
        while not ray.wait([ref], timeout=every_s)[0]:
            probe()
        self.pending = None
        return self._result(ref)

    def settled(self, timeout_s: float) -> bool:
        """Whether the call a probe left waiting (`watched`) ended within `timeout_s`, so the
        actor's `default` group takes calls again."""
        if self.pending is None:
            return True
        done = bool(ray.wait([self.pending], timeout=timeout_s)[0])
        if done:
            self.pending = None
        return done

    def close(self) -> None:
        try:
            self._result(self.actor.close.remote())
        finally:
            ray.kill(self.actor)

    def kill(self) -> None:
        """End the actor now, without its close (the actors it owns end with it)."""
        ray.kill(self.actor)
