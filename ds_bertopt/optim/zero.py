"""Keep LAMB layer-wise when DeepSpeed wraps it: read where each layer lives, refuse what we cannot.

What DeepSpeed 0.16-0.19 does to a client optimizer (read, not guessed; the attributes through
:mod:`ds_bertopt.compat.deepspeed`, hook ``zero.hp_mapping``):

* **ZeRO 1/2** — ``runtime/zero/stage_1_and_2.py::DeepSpeedZeroOptimizer.__init__`` flattens each
  param group into ``bit16_groups_flat[i]``, keeps this rank's slice as the fp32 tensor
  ``single_partition_of_fp32_groups[i]`` and sets the client's ``param_group["params"]`` to
  ``[that slice]``. ``_link_all_hp_params`` → ``utils/mixed_precision_linkage.py::link_hp_params``
  gives each model parameter with elements in the slice a ``param._hp_mapping``
  (``utils/tensor_fragment.py::tensor_fragment``) whose ``get_hp_fragment_address()`` is
  ``(start, numel)`` in the slice; parameters outside it get ``None``. ``step`` calls
  ``_optimizer_step(i)``, which swaps ``param_groups`` to ``[group i]`` around our ``step``.
* **bf16 at ZeRO 1 with fp32 gradient accumulation** — ``runtime/bf16_optimizer.py::BF16_Optimizer``:
  the same linkage over ``bf16_groups`` / ``fp32_groups_flat_partition``, all groups in one call.
* **bf16 at ZeRO 0** — ``runtime/fp16/unfused_optimizer.py::FP16_UnfusedOptimizer`` hands us one fp32
  copy per parameter: whole layers already.
* **ZeRO 3** partitions the parameters themselves; refused with a config error.

Before stepping us, all of them compute the unscaled global gradient norm (``_global_grad_norm``),
which LAMB's own clipping reads when it only sees a shard.
"""

from __future__ import annotations

import torch

from ..compat.deepspeed import (
    HP_MAPPING_ABSENT,
    KNOWN_GOOD,
    global_grad_norm,
    hp_fragment,
    partitioned_groups,
    shard_process_groups,
    unpartitioned_groups,
)
from ..errors import ConfigError
from ..log import print0
from .lamb import Fragment, Lamb, Layout


def _internals_changed(what: str) -> RuntimeError:
    return RuntimeError(
        f"LAMB under DeepSpeed: {what}; ds_bertopt.optim.zero was checked against DeepSpeed "
        f"{', '.join(KNOWN_GOOD)} (hook zero.hp_mapping) and will not guess a layout"
    )


def _check_fragment(mapping, shard: torch.Tensor, start: int, numel: int, where: str) -> None:
    """The fragment must be a view of ``shard`` at ``start`` holding the parameter's own values."""
    hp = mapping.hp
    inside = (
        hp.numel() == numel
        and 0 <= start
        and start + numel <= shard.numel()
        and hp.data_ptr() == shard.data_ptr() + start * shard.element_size()
    )
    if not inside:
        raise _internals_changed(f"{where}: its _hp_mapping fragment is not a view of the flat shard at offset {start}")
    # The model parameter is the (rounded) master weight: if the mapping paired the wrong elements
    # this fails for all but constant tensors.
    if not torch.equal(hp.to(mapping.lp.dtype), mapping.lp):
        raise _internals_changed(f"{where}: the fp32 master fragment does not hold the parameter's values")


def layouts_from_hp_mapping(optimizer: Lamb, wrapper) -> list[Layout]:
    """Per param group, where each layer's fragment lies in this rank's flat shard."""
    lp_groups, hp_shards = partitioned_groups(wrapper)
    if len(lp_groups) != len(optimizer.param_groups) or len(hp_shards) != len(optimizer.param_groups):
        raise _internals_changed(
            f"{type(wrapper).__name__} has {len(lp_groups)} parameter groups, LAMB has {len(optimizer.param_groups)}"
        )
    process_groups = shard_process_groups(wrapper)
    if process_groups is None:
        raise _internals_changed(f"{type(wrapper).__name__} has no real_dp_process_group")
    layouts = []
    for i, (group, lp_params, shard) in enumerate(zip(optimizer.param_groups, lp_groups, hp_shards)):
        if len(group["params"]) != 1 or group["params"][0] is not shard:
            raise _internals_changed(f"param group {i} does not hold exactly the flat fp32 shard")
        fragments = []
        for layer, lp in enumerate(lp_params):
            where = f"group {i} parameter {layer} (shape {tuple(lp.shape)})"
            mapping = hp_fragment(lp)
            if mapping is HP_MAPPING_ABSENT:
                raise _internals_changed(
                    f"{where} has no _hp_mapping (utils/mixed_precision_linkage.py::link_hp_params)"
                )
            if mapping is None:  # no element of this layer in this rank's shard
                continue
            _check_fragment(mapping, shard, mapping.start, mapping.numel, where)
            fragments.append(Fragment(0, mapping.start, mapping.numel, layer))
        layout = Layout(tuple(fragments), len(lp_params), process_groups[i])
        optimizer.set_layout(shard, layout)
        layouts.append(layout)
    return layouts


def _wrapper_grad_norm(wrapper) -> torch.Tensor:
    """DeepSpeed's global norm as it is (a device tensor after a normal step): reading it on the host would sync."""
    norm = global_grad_norm(wrapper)
    if norm is None:
        raise RuntimeError(
            "LAMB max_grad_norm needs DeepSpeed's global gradient norm, which it did not compute "
            "(zero_optimization.compute_grad_norm false?); set bertopt.optimizer.max_grad_norm to 0"
        )
    return torch.as_tensor(norm)


def _mark_unflattened(optimizer: Lamb, wrapper) -> None:
    """Wrappers that keep one tensor per parameter (fp32 copies): check shapes, then trust them."""
    lp_groups = unpartitioned_groups(wrapper)
    for i, group in enumerate(optimizer.param_groups):
        held = group["params"]
        if all(id(t) in optimizer._whole_layers for t in held):
            continue
        if (
            lp_groups is None
            or i >= len(lp_groups)
            or [tuple(t.shape) for t in held] != [tuple(p.shape) for p in lp_groups[i]]
        ):
            raise _internals_changed(
                f"{type(wrapper).__name__} holds param group {i} in a layout LAMB does not "
                "know (neither one tensor per parameter nor ZeRO 1/2 shards)"
            )
        optimizer.mark_whole_layers(held)


def refuse_lamb_under_zero3(stage: int) -> None:
    """The one place LAMB's ZeRO-3 refusal is decided (pre-flight, ``build_optimizer``, the HF integration, here)."""
    if stage >= 3:
        raise ConfigError(
            'optimizer.type: "lamb" is not supported under ZeRO stage 3 (parameters are '
            'partitioned); use zero_optimization.stage 0, 1 or 2, or type "adamw"'
        )


def attach_lamb(optimizer: Lamb, engine) -> None:
    """Make ``optimizer`` take per-layer steps inside ``engine`` (``deepspeed.initialize``'s result)."""
    stage = int(engine.zero_optimization_stage())
    refuse_lamb_under_zero3(stage)
    ds_clip = float(engine.gradient_clipping() or 0.0)
    if optimizer.max_grad_norm > 0 and ds_clip > 0:
        print0(
            f"DeepSpeed gradient_clipping ({ds_clip:g}) is on, so LAMB's own global-norm clipping "
            f"(max_grad_norm {optimizer.max_grad_norm:g}) is off: DeepSpeed clips the same global norm first"
        )
        optimizer.max_grad_norm = 0.0
    wrapper = engine.optimizer
    if wrapper is optimizer:
        print0("LAMB: DeepSpeed steps it directly (ZeRO 0, fp32); trust ratio per parameter")
        return
    if partitioned_groups(wrapper) is None:
        _mark_unflattened(optimizer, wrapper)
        print0(f"LAMB: {type(wrapper).__name__} holds one fp32 copy per parameter; trust ratio per parameter")
        return
    layouts = layouts_from_hp_mapping(optimizer, wrapper)
    optimizer.set_grad_norm_source(lambda: _wrapper_grad_norm(wrapper))
    held = sum(len(layout.fragments) for layout in layouts)
    layers = sum(layout.num_layers for layout in layouts)
    print0(
        f"LAMB: layer-wise trust ratio over {type(wrapper).__name__} (ZeRO {stage}) shards: {layers} "
        f"parameters in {len(layouts)} groups, {held} fragments on rank 0; per-layer norms all-reduced "
        "once per group per step"
    )
