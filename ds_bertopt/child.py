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
from typing import Callable, Mapping, Optional

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


def _child_entry(queue, fn: Callable, args: tuple) -> None:
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


def run_in_child(fn: Callable, *args, env: Optional[Mapping[str, str]] = None, timeout: float = 900):
    """``fn(*args)`` in a fresh spawned process (``fn`` importable, module-level); return its result.

    ``env`` entries are set in the child's environment before it starts (e.g. the malloc setting that
    lets RSS follow live tensors). A :class:`~ds_bertopt.errors.BertOptError` in the child is raised again, same
    class and one line; running out of memory raises :class:`OutOfMemory`; any other failure, a child that dies, or
    one still running after ``timeout`` seconds raises :class:`ChildDied`, with its message.
    """
    ctx = mp.get_context("spawn")
    with environment_set(env or {}):
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_entry, args=(queue, fn, args))
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
