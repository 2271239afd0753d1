"""Running a function in a fresh child process, and saying what became of it (the memory measurements' children).

The parent never waits on a dead child: it polls the child while it waits for its result. A child that runs out of
memory (it says so, or it was killed by SIGKILL, as the kernel's out-of-memory killer and cgroup limits kill) raises
:class:`OutOfMemory`; one that dies otherwise, fails, or outlives its timeout raises :class:`ChildDied`. Light on
purpose (no torch here): a child imports only what its function needs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import time
import warnings
from typing import Callable, Mapping, Optional, Sequence

from . import errors


class OutOfMemory(RuntimeError):
    """A measured child ran out of memory: what it measured does not fit any budget."""


class ChildDied(RuntimeError):
    """A child ended without a result and not for lack of memory (a crash, an exit, a timeout)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's ``torch.OutOfMemoryError``, Python's ``MemoryError``, or the CPU allocator's refusal (c10
    ``alloc_cpu.cpp``: ``DefaultCPUAllocator: can't allocate memory``, a plain ``RuntimeError``)."""
    torch = sys.modules.get("torch")  # a child that never imported torch raised none of its errors
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def take_environment(environ: Mapping[str, str]) -> None:
    """A forked process starts with its fork server's environment: take the caller's instead, as spawn would."""
    os.environ.clear()
    os.environ.update(environ)


def _child_entry(queue, fn: Callable, args: tuple, environ: Optional[Mapping[str, str]] = None) -> None:
    if environ is not None:
        take_environment(environ)
    # a child's stderr is the user's terminal: transformers' own deprecation notices (its checkpointing calls
    # is_gradient_checkpointing) would print once per measured setup
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    try:
        queue.put(("ok", fn(*args)))
    except errors.BertOptError as exc:  # bad input (a target matching nothing, ...): the parent says it in one line
        queue.put((type(exc).__name__, str(exc)))
    except BaseException as exc:  # report, never hang the parent
        status = "oom" if is_out_of_memory(exc) else "error"
        queue.put((status, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


POLL_S = 0.2
"""How often the parent checks that a child it waits on is still alive."""


def _dead_child(exitcode: Optional[int]) -> RuntimeError:
    """What a child that ended without a result means: SIGKILL is how the kernel's out-of-memory killer (and a
    cgroup's memory limit) ends a process, so it counts as out of memory; anything else is a crash."""
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        if number == signal.SIGKILL:
            return OutOfMemory(f"the child was killed by {name} (as the out-of-memory killer kills)")
        return ChildDied(f"the child was killed by {name} without a result")
    return ChildDied(f"the child exited with status {exitcode} without a result")


def _wait_for_result(queue, proc, timeout: float):
    """The child's ``(status, result)``; raises as soon as the child is gone without one (never waits out
    ``timeout`` on a dead child), or after ``timeout`` on a live one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=POLL_S)
        except queue_mod.Empty:
            pass
        if not proc.is_alive():
            try:  # its last words may still be in the pipe
                return queue.get(timeout=1.0)
            except queue_mod.Empty:
                raise _dead_child(proc.exitcode) from None
        if time.monotonic() > deadline:
            raise ChildDied(f"the child gave no result within {timeout:.0f} s")


@contextlib.contextmanager
def environment_set(env: Mapping[str, str]):
    """``env`` in ``os.environ`` for the block (what a process started there inherits), the previous values after."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def forkserver_context(preload: Sequence[str], server_env: Optional[Mapping[str, str]] = None):
    """The ``forkserver`` context, its server started with ``preload`` imported under ``server_env``. One server per
    process: it lives as long as this process, and a later call reuses it with the modules it was started with (a
    child imports what is missing, at a child's cost)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    with environment_set(server_env or {}):
        forkserver.ensure_running()
    return ctx


def stop_forkserver() -> None:
    """Stop this process's fork server (:func:`forkserver_context`), if one runs, so that a training run does not keep
    its preloaded modules (about 400 MB of RSS with torch) for hours after measuring; the next call starts another.
    ``ForkServer._stop`` is CPython's own (``multiprocessing/forkserver.py``, 3.8 on); where absent, it stays."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def run_in_child(
    fn: Callable,
    *args,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 900,
    preload: Sequence[str] = (),
):
    """``fn(*args)`` in a fresh process (``fn`` importable, module-level); return its result.

    The process is spawned, or, with ``preload``, forked from a server that imported those modules once
    (:func:`forkserver_context`: a child then costs a fork, not seconds of imports, and starts with them in its
    heap, as a spawned one would hold them once it imported them). Either way it runs with this process's
    environment plus ``env``; what the C runtime reads only at start-up (``OMP_NUM_THREADS``, glibc's ``MALLOC_*``)
    was read by the server, so ``fn`` sets those itself (``torch.set_num_threads``, ``mallopt``). A
    :class:`~ds_bertopt.errors.BertOptError` in the child is raised again, same class and one line; running out of
    memory raises :class:`OutOfMemory`; any other failure, a child that dies, or one still running after
    ``timeout`` seconds raises :class:`ChildDied`, with its message.
    """
    ctx = forkserver_context(preload) if preload else mp.get_context("spawn")
    environ = {**os.environ, **(env or {})} if preload else None  # a spawned child inherits it from the block
    with environment_set(env or {}):
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_entry, args=(queue, fn, args, environ))
        proc.start()
    try:
        status, result = _wait_for_result(queue, proc, timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status == "ok":
        return result
    if status == "oom":
        raise OutOfMemory(f"the child ran out of memory: {result}")
    user_error = getattr(errors, status, None)
    if isinstance(user_error, type) and issubclass(user_error, errors.BertOptError):
        raise user_error(result)
    raise ChildDied(f"child failed: {result}")
