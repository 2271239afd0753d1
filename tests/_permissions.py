"""File permissions that apply to root too, for the tests of unreadable and unwritable paths.

CI runs as root, and root reads and writes every file whatever its mode (the capabilities ``CAP_DAC_OVERRIDE`` and
``CAP_DAC_READ_SEARCH``), so a ``chmod 0`` file is no bad input there and such tests used to skip. Inside
:func:`permissions_apply` the calling thread runs without those two capabilities in its effective set (``capset``,
per thread; both stay in the permitted set and are restored on exit), so ``open`` fails with ``EACCES`` exactly as
it does for a user; ``os.access(..., effective_ids=True)`` agrees (plain ``os.access`` asks with the real uid and,
for root, with the permitted set: it still says yes). For other users it changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

_CAPABILITY_V3 = 0x20080522
_DAC_OVERRIDE, _DAC_READ_SEARCH = 1, 2


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capabilities(libc, data=None):
    header = _Header(_CAPABILITY_V3, 0)
    call, data = (libc.capget, (_Data * 2)()) if data is None else (libc.capset, data)
    if call(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget/capset failed")
    return data


@contextlib.contextmanager
def permissions_apply() -> Iterator[None]:
    """File modes bind this thread while inside, even as root (see the module docstring)."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    data = _capabilities(libc)
    saved = data[0].effective
    data[0].effective &= ~((1 << _DAC_OVERRIDE) | (1 << _DAC_READ_SEARCH))
    _capabilities(libc, data)
    try:
        yield
    finally:
        data[0].effective = saved
        _capabilities(libc, data)
