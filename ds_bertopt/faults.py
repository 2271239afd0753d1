"""Fault injection for the reliability tests (inactive unless ``DS_BERTOPT_FAULT`` is set).

``DS_BERTOPT_FAULT="ACTION@POINT:rank=R:step=S"`` (``step>=S`` for every step from S on), e.g.
``kill@forward:rank=1:step=3`` SIGKILLs rank 1 mid-step 3 (after its forward, before backward),
``kill@save:rank=1:step=4`` dies inside the step-4 checkpoint after DeepSpeed wrote its files,
``raise@forward:…`` raises, ``hang@forward:…`` stops responding, ``nan@loss:rank=0:step>=2`` turns
the loss into NaN, ``enospc@write:rank=0:step=4`` makes rank 0's first checkpoint file write of step 4
fail as a full disk does (``OSError`` ENOSPC), ``sleep20@build:rank=0:step>=1`` makes every part of rank 0's data
build 20 s slower (at ``build`` the step is the part's number in the process's whole build). Real jobs never set
it; the cost when unset is one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time

_SPEC = re.compile(r"^(kill|raise|hang|nan|enospc|sleep\d+)@(\w+):rank=(\d+):step(>=|=)(\d+)$")


def _parse():
    text = os.environ.get("DS_BERTOPT_FAULT", "")
    if not text:
        return None
    match = _SPEC.match(text)
    if not match:
        raise ValueError(f"DS_BERTOPT_FAULT={text!r} is not ACTION@POINT:rank=R:step=S")
    action, point, rank, op, step = match.groups()
    return action, point, int(rank), op, int(step)


def inject(point: str, rank: int, step: int, value=None):
    """At ``point`` of ``step`` on ``rank``, do what ``DS_BERTOPT_FAULT`` says; returns ``value``."""
    spec = _parse()
    if spec is None:
        return value
    action, where, who, op, at = spec
    if where != point or who != rank or not (step == at if op == "=" else step >= at):
        return value
    print(f"[ds_bertopt rank {rank}] fault injection: {action} at {point} of step {step}", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise RuntimeError(f"injected failure at {point} of step {step}")
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"injected at {point} of step {step}")
    if action.startswith("sleep"):
        time.sleep(int(action[len("sleep") :]))
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "nan" and value is not None:
        return value * float("nan")
    return value
