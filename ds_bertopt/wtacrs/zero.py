"""Parameters used inside our autograd backwards under ZeRO-3 and autocast.

ZeRO-3 gathers a module's parameters before its backward through the hooks that
``deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module`` puts on
every submodule, so a weight saved in forward is normally whole again in backward. If it is not
(a module reached outside those hooks), we do what DeepSpeed's own
``deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3.backward`` does: ``all_gather()`` a
parameter whose ``ds_status`` is ``NOT_AVAILABLE``, use it, and ``partition()`` it again afterwards.
Gradients are always returned through autograd, full-shape; DeepSpeed's reduce hooks partition them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..compat.deepspeed import is_zero3_param, zero3_status


def _is_partitioned(param: Optional[torch.Tensor]) -> bool:
    return param is not None and is_zero3_param(param) and zero3_status(param) == "NOT_AVAILABLE"


@contextlib.contextmanager
def gathered(*params: Optional[torch.Tensor]) -> Iterator[None]:
    """Make ZeRO-3-partitioned ``params`` whole for the duration of the block, then re-partition."""
    partitioned = [p for p in params if _is_partitioned(p)]
    for param in partitioned:
        param.all_gather()
    try:
        yield
    finally:
        for param in partitioned:
            param.partition()


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is on for ``device_type``, else ``None``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device_type: str):
    """Backward runs in whatever autocast state the caller has; ours computes in the saved dtypes."""
    return torch.autocast(device_type=device_type, enabled=False)
