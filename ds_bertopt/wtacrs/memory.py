"""Measuring what fine-tuning keeps for backward and how high a step's memory goes.

* :func:`saved_tensor_bytes` counts the bytes autograd actually saves in one forward, through
  ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage (a tensor kept by a
  LayerNorm and three linears counts once), parameters excluded, grouped by the innermost module
  that saved it (linear inputs, attention, dropout, layernorm, activation, weight copies, other).
* :func:`estimate_saving` compares a model with its WTA-CRS-converted copy on one batch.
* :func:`measure_step` runs in a fresh child process, on a CPU forked from a server that imported torch and
  transformers' model code once (:data:`CHILD_PRELOAD`), with glibc's mmap threshold at 64 KiB (:func:`_malloc_for`:
  freed blocks go back to the OS and RSS tracks live tensors): it loads and prepares a variant, takes a
  warm-up step, resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), takes one
  measured step (forward, backward, AdamW step) and reports the peak above the RSS of the interpreter with those
  modules imported — weights, gradients, optimizer state, activations and transients, the CPU analogue of a
  GPU's ``max_memory_allocated``. The model is a checkpoint directory or, for family comparisons,
  a random-init transformers config (``model_config``: ``{"model_type": ..., **config kwargs}``).
  On CUDA a process holds more than its tensors: the peak is the caching allocator's reserved peak
  (``max_memory_reserved``) plus what the process holds outside it, its CUDA context and NCCL's buffers
  (:func:`device_overhead`, measured once per device), so that a budget is compared with what the card must hold.
* :func:`run_in_child` is the fresh-process helper behind it (production code, no test
  helpers): a child that runs out of memory raises :class:`OutOfMemory` (reported by the child, or a child killed
  by SIGKILL, as the kernel's out-of-memory killer kills); a child that dies otherwise raises :class:`ChildDied` at
  once, never after the timeout. The default fine-tuning model is found by
  ``ds_bertopt.model.local.default_model_dir``.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import math
import os
import re
import time
from contextlib import ExitStack
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..compat.transformers import TORCH_MODULES
from ..configlib import load_section
from ..child import OutOfMemory, run_in_child
from .config import WtaCrsConfig
from .convert import convert, prepare_model
from .families import detect, matches
from .kit import Bf16InputGelu
from .linear import SampledLinear

CATEGORIES = ("linear inputs", "attention", "dropout", "layernorm", "activation", "weight copies", "other")
CHILD_PRELOAD = ("torch", "transformers", "transformers.modeling_utils", __name__)
"""What the fork server of the CPU measurements' children imports once (about 8 s on a 2-core CPU): each child, one
per measured setup or peak, then costs a fork, and their import is the baseline the peak is measured above
(:func:`_warmed`). A model family's own module (``modeling_bert``, ...) is still imported by the child, after the
baseline. CUDA measurements spawn their children (:func:`_preload`)."""
MiB = 1024 * 1024


def _category(stack: list[tuple[str, nn.Module]], tensor: torch.Tensor, attention: str) -> str:
    if not stack:
        return "other"
    name, module = stack[-1]
    if isinstance(module, nn.Linear):
        return "weight copies" if tuple(tensor.shape) == tuple(module.weight.shape) else "linear inputs"
    if isinstance(module, nn.Dropout):
        return "dropout"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, (nn.GELU, Bf16InputGelu)) or type(module).__name__.endswith("Activation"):
        return "activation"
    if any(matches(n, attention) for n, _ in stack if n):
        return "attention"
    return "other"


def saved_tensor_bytes(model: nn.Module, batch: dict, autocast_dtype: Optional[torch.dtype] = None) -> dict[str, int]:
    """Bytes saved for backward by one training forward of ``model(**batch)``, by category, plus ``total``."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    attention = detect(getattr(model, "hf", model)).family.attention.module  # an unpadded wrapper: its HF model
    stack: list[tuple[str, nn.Module]] = []
    seen: dict[int, tuple[str, int]] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in param_storages and ptr not in seen:
            seen[ptr] = (_category(stack, tensor, attention), storage.nbytes())
        return tensor

    def enter(name, module, args):
        stack.append((name, module))

    def leave(module, args, output):
        stack.pop()  # returning it would replace the module's output

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(functools.partial(enter, name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    was_training = model.training
    model.train()
    try:
        with ExitStack() as stack_ctx:
            stack_ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            if autocast_dtype is not None:
                stack_ctx.enter_context(torch.autocast(next(model.parameters()).device.type, dtype=autocast_dtype))
            output = model(**batch)
        del output  # the saved tensors are alive until here; their storages were never reused
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    totals = {category: 0 for category in CATEGORIES}
    for category, nbytes in seen.values():
        totals[category] += nbytes
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    return totals


def estimate_saving(
    model: nn.Module,
    batch: dict,
    ratio: float = 0.3,
    targets=("auto",),
    min_k: int = 32,
    autocast_dtype: Optional[torch.dtype] = None,
) -> dict[str, dict[str, int]]:
    """Saved-for-backward bytes of ``model`` and of a WTA-CRS-converted copy on ``batch``."""

    converted = copy.deepcopy(model)
    convert(converted, ratio, targets, min_k)
    return {
        "original": saved_tensor_bytes(model, batch, autocast_dtype),
        "converted": saved_tensor_bytes(converted, batch, autocast_dtype),
    }


# ---------------------------------------------------------------- step peak in a fresh child
def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def synthetic_batch(batch: int, seq: int, vocab: int, seed: int = 0, num_labels: int = 2) -> dict:
    """Full-length random token ids (no padding: the worst case for memory) and random labels."""
    gen = torch.Generator().manual_seed(seed)
    low = 1000 if vocab > 2000 else 1  # past BERT's [unused]/special ids when the vocabulary has them
    return {
        "input_ids": torch.randint(low, vocab, (batch, seq), generator=gen),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (batch,), generator=gen),
    }


def build_model(model_dir: Optional[str] = None, model_config: Optional[Mapping[str, Any]] = None, num_labels: int = 2):
    """A sequence-classification model: pretrained from ``model_dir``, or random-init from ``model_config``
    (``{"model_type": "deberta-v2", **kwargs}`` for ``transformers.AutoConfig.for_model``; no download)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if model_config is not None:
        kwargs = dict(model_config)
        config = AutoConfig.for_model(kwargs.pop("model_type"), num_labels=num_labels, **kwargs)
        return AutoModelForSequenceClassification.from_config(config)
    if model_dir is None:
        raise ValueError("build_model: give model_dir or model_config")
    return AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels, **TORCH_MODULES)


def load_variant(
    model_dir: Optional[str],
    wtacrs: dict,
    num_labels: int = 2,
    seed: int = 0,
    model_config: Optional[Mapping[str, Any]] = None,
):
    """A sequence-classification model (see :func:`build_model`) prepared per a ``wtacrs`` config dict."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a child's stderr is the user's terminal
    torch.manual_seed(seed)
    cfg = load_section(WtaCrsConfig, wtacrs, "wtacrs")
    model = build_model(model_dir, model_config, num_labels)
    model, _ = prepare_model(model, cfg)
    model.train()
    return model


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Weight precisions a measured step runs in (``spec["precision"]``); bf16/fp16 as DeepSpeed's bf16/fp16 modes
hold a model: low-precision weights and gradients, fp32 master weights and AdamW state (:class:`MasterAdamW`)."""


class MasterAdamW:
    """AdamW over fp32 master copies of low-precision parameters: what DeepSpeed's bf16/fp16 optimizers keep
    (weights and gradients in the model's dtype, fp32 master weights, fp32 moments), so a measured bf16 step has
    their memory and their per-step copies."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr)

    def step(self) -> None:
        for param, master in zip(self.params, self.masters):
            master.grad = param.grad.float() if param.grad is not None else None
        self.inner.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - gradients are always dropped
        for tensor in self.params + self.masters:
            tensor.grad = None


def train_step(model, optimizer, batch: dict, autocast_dtype: Optional[torch.dtype] = None) -> float:
    device_type = next(model.parameters()).device.type
    with ExitStack() as stack:
        if autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=autocast_dtype))
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def peak_unmeasurable(device_type: str) -> Optional[str]:
    """Why a step's peak memory cannot be measured on ``device_type`` here (``None``: it can). CPU: the RSS
    high-water mark of a fresh child (Linux ``/proc/self/status`` and ``clear_refs``); CUDA:
    ``torch.cuda.max_memory_allocated``; nothing else."""
    if device_type == "cpu":
        if not (os.access("/proc/self/clear_refs", os.W_OK) and os.path.isfile("/proc/self/status")):
            return "no /proc/self/clear_refs to reset the RSS high-water mark (the CPU peak needs Linux)"
        return None
    if device_type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    return f"no peak-memory counter for {device_type!r} (CPU RSS on Linux and CUDA are measured)"


def sequence_classification(spec: dict) -> tuple[nn.Module, Callable[[int, int, int], dict]]:
    """The default ``spec["build"]``: ``(model, make_batch)``, :func:`load_variant`'s model and
    :func:`synthetic_batch`'s padded batches; ``make_batch(sequences, seq, seed)``."""
    num_labels = spec.get("num_labels", 2)
    model = load_variant(
        spec.get("model"), spec.get("wtacrs", {}), num_labels, spec.get("seed", 0), spec.get("model_config")
    )
    vocab = model.config.vocab_size if hasattr(model, "config") else 30522
    return model, lambda sequences, seq, seed: synthetic_batch(sequences, seq, vocab, seed, num_labels)


def _prepared(spec: dict):
    """The model, optimizer, autocast dtype, device and batch maker of a measured run (``spec``: see
    :func:`measure_step`)."""
    device = torch.device(spec.get("device", "cpu"))
    model, make_batch = (spec.get("build") or sequence_classification)(spec)
    model = model.to(device)
    dtype = PRECISIONS[spec.get("precision", "fp32")]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if dtype == torch.float32:
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    else:
        model.to(dtype)  # the engine's bf16/fp16 mode: the whole module in that dtype
        optimizer = MasterAdamW(trainable, lr=1e-5)
    autocast = torch.bfloat16 if spec.get("bf16_autocast") else None
    return model, optimizer, autocast, device, make_batch


def _on(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(spec: dict) -> dict[str, Any]:
    """Child-process entry: peak memory of one training step of a variant (see module docstring).

    ``spec``: ``model`` (dir) or ``model_config`` (random init, see :func:`build_model`), ``wtacrs``
    (config dict), ``batch``, ``seq``, ``precision`` (``fp32``/``bf16``/``fp16`` weights, :data:`PRECISIONS`),
    ``bf16_autocast`` (bool), ``device`` (``cpu``: RSS above the bare interpreter; ``cuda``:
    ``max_memory_reserved``, weights included, to which :func:`measure_step_in_child` adds
    :func:`device_overhead`), ``threads``, ``seed``, ``num_labels``; ``build``: a module-level
    ``spec -> (model, make_batch)`` (default :func:`sequence_classification`;
    ``ds_bertopt.train.finetune_memory.task_variant`` takes ``task`` and ``packed``: any fine-tuning task, padded or
    packed rows of ``batch`` sequences of ``seq`` tokens); ``saved: False`` skips counting the saved-for-backward
    bytes (one more forward) when only the peak is wanted.
    """
    _malloc_for(peak=True)
    run = _warmed(spec)
    model, optimizer, dtype, _, _, runtime_kib = run
    trainable = [p for p in model.parameters() if p.requires_grad]
    batch, peak = _peak_step(run, spec, spec["batch"])
    saved = saved_tensor_bytes(model, batch, dtype) if spec.get("saved", True) else None
    flops = step_flops(model, optimizer, batch, dtype) if spec.get("flops") else None
    return {
        **peak,
        "process_peak": _proc_status_kib("VmHWM") * 1024,
        "runtime": runtime_kib * 1024,
        "saved": saved,
        "pid": os.getpid(),
        "flops": flops,
        "trainable": sum(p.numel() for p in trainable),
        "sampled": sum(isinstance(m, SampledLinear) for m in model.modules()),
    }


def probe_steps(spec: dict) -> dict[str, Any]:
    """Child-process entry: the step peak at each of ``spec["batches"]`` (``spec`` as :func:`measure_step`), one after
    the other, then each one's step time under a warm default-like allocator (:func:`_malloc_for`; one untimed step at
    the largest first, then the shortest of ``spec["repeats"]``, default 1, at each): what the budget mode's fast
    search fits its lines to, and how it verifies and times a setup at its batch in one child (:mod:`.sizing`).
    ``spec["time_under"]``: only batches whose peak is at most this many bytes are timed (the others' time is
    ``inf``). Returns ``{"peaks": {batch: bytes}, "step_s": {batch: s}}``."""
    _malloc_for(peak=True)
    run = _warmed(spec)
    model, optimizer, dtype, device, _, _ = run
    peaks, times, made = {}, {}, {}
    for sequences in spec["batches"]:
        made[sequences], peak = _peak_step(run, spec, sequences)
        peaks[sequences], times[sequences] = peak["step_peak"], peak["step_s"]
    limit = spec.get("time_under")
    made = {b: batch for b, batch in made.items() if limit is None or peaks[b] <= limit}
    times = {b: times[b] if b in made else math.inf for b in times}
    if not made:
        return {"peaks": peaks, "step_s": times}
    if _malloc_for(peak=False):  # else: timed under the peak's setting
        train_step(model, optimizer, made[max(made)], dtype)
        times = {b: math.inf for b in times}
    for sequences, batch in made.items():
        for _ in range(int(spec.get("repeats", 1))):
            start = time.perf_counter()
            train_step(model, optimizer, batch, dtype)
            _sync(device)
            times[sequences] = min(times[sequences], time.perf_counter() - start)
    _malloc_for(peak=True)
    return {"peaks": peaks, "step_s": times}


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc ``mallopt`` parameters (malloc.h)."""


@functools.lru_cache(maxsize=None)
def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _malloc_for(peak: bool) -> bool:
    """Switches glibc's malloc, in this process, to the peak's setting (``MALLOC_MMAP_THRESHOLD_=65536``: a block
    over 64 KiB is its own mapping and a freed one goes back to the OS, so RSS follows live tensors; free heap pages
    trimmed now) or to one like the default allocator's once warm: glibc's dynamic mmap threshold rises, as blocks
    are freed, up to ``DEFAULT_MMAP_THRESHOLD_MAX`` (32 MiB on 64-bit) and the trim threshold to twice it (malloc.c
    ``__libc_free``), so steps reuse freed blocks instead of faulting in fresh pages, which would charge more time to
    the setups that allocate more. One child can then measure peaks and rank step times. ``False``: no glibc
    ``mallopt`` here."""
    libc = _glibc()
    if libc is None:
        return False
    threshold = 64 * 1024 if peak else 32 * MiB
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024 if peak else 2 * threshold)
    if peak:
        libc.malloc_trim(0)
    return True


def _warmed(spec: dict):
    """``(model, optimizer, autocast dtype, device, batch maker, RSS KiB of the interpreter before the model)``
    of ``spec``'s measured run, after one warm-up step."""
    torch.set_num_threads(int(spec.get("threads", 1)))
    import transformers  # noqa: F401  - import cost belongs to the baseline, not the step

    gc.collect()
    runtime_kib = _proc_status_kib("VmRSS")
    model, optimizer, dtype, device, make_batch = _prepared(spec)
    warm = _on(make_batch(2, min(16, spec["seq"]), 1), device)
    train_step(model, optimizer, warm, dtype)
    return model, optimizer, dtype, device, make_batch, runtime_kib


def _peak_step(run: tuple, spec: dict, sequences: int):
    """``(batch, figures)``: one step of ``sequences`` × ``spec["seq"]`` with the peak memory it reached above the
    interpreter (CPU: RSS high-water mark reset just before; CUDA: the allocator's reserved peak); ``run``:
    :func:`_warmed`'s."""
    model, optimizer, dtype, device, make_batch, runtime_kib = run
    batch = _on(make_batch(sequences, spec["seq"], spec.get("seed", 0)), device)
    gc.collect()
    resident_kib = _proc_status_kib("VmRSS")
    if device.type == "cuda":
        _sync(device)
        resident = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        exact_peak = True
    else:
        exact_peak = _reset_peak()
    start = time.perf_counter()
    train_step(model, optimizer, batch, dtype)
    _sync(device)
    step_s = time.perf_counter() - start
    allocated_peak = None
    if device.type == "cuda":  # what the allocator held (its cache included); the context: device_overhead
        step_peak, resident_before = torch.cuda.max_memory_reserved(device), resident
        allocated_peak = torch.cuda.max_memory_allocated(device)
    else:
        peak_kib = _proc_status_kib("VmHWM")
        step_peak, resident_before = (peak_kib - runtime_kib) * 1024, (resident_kib - runtime_kib) * 1024
    figures = {
        "step_peak": step_peak,
        "allocated_peak": allocated_peak,
        "resident_before": resident_before,
        "step_s": step_s,
        "exact_peak": exact_peak,
    }
    return batch, figures


def step_flops(model, optimizer, batch: dict, autocast_dtype: Optional[torch.dtype] = None) -> int:
    """FLOPs of one training step (forward, backward, recomputations) counted by ``torch.utils.flop_counter``:
    matrix products and attention kernels only, a proxy for step time that no other load on the machine moves."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        train_step(model, optimizer, batch, autocast_dtype)
    return int(counter.get_total_flops())


def step_fn(spec: dict) -> Callable[[], None]:
    """One training step (forward, backward, optimizer) of ``spec``'s setup (as :func:`measure_step`; ``batch`` ×
    ``seq`` random tokens) as a function of nothing that returns nothing (so ``testing.measure.interleaved`` times
    it); the model, optimizer and batch are built once, here."""
    model, optimizer, dtype, device, make_batch = _prepared(spec)
    batch = _on(make_batch(spec["batch"], spec["seq"], spec.get("seed", 0)), device)

    def step() -> None:
        train_step(model, optimizer, batch, dtype)  # its loss.item() waits for the device
        _sync(device)

    return step


def _preload(spec: dict) -> tuple[str, ...]:
    """:data:`CHILD_PRELOAD` for a CPU measurement; none (a spawned child) on an accelerator: a process that queried
    CUDA (``torch.cuda.is_available`` initializes the driver, as an import may) leaves its forks unable to use it."""
    return CHILD_PRELOAD if torch.device(spec.get("device", "cpu")).type == "cpu" else ()


def measure_step_in_child(spec: dict, timeout: float = 900) -> dict[str, Any]:
    """:func:`measure_step` in a fresh process (:data:`CHILD_PRELOAD`'s fork server); on CUDA its
    ``step_peak`` is what the process held: the allocator's reserved peak plus :func:`device_overhead`. Raises
    :class:`OutOfMemory` when the step did not fit."""
    result = run_in_child(measure_step, spec, timeout=timeout, preload=_preload(spec))
    result["overhead"] = device_overhead(spec.get("device", "cpu"))
    result["step_peak"] += result["overhead"]
    return result


def probe_in_child(spec: dict, batches: list[int], budget: Optional[float] = None, timeout: float = 900) -> dict:
    """:func:`probe_steps` of ``spec`` at ``batches`` in a fresh process (the peak's malloc setting; on CUDA each peak
    plus :func:`device_overhead`); with ``budget`` (bytes, as the peaks count them) only batches that fit it are
    timed. Raises :class:`OutOfMemory` when a step did not fit the device."""
    overhead = device_overhead(spec.get("device", "cpu"))
    child_spec = {**spec, "batches": list(batches)}
    if budget is not None:
        child_spec["time_under"] = budget - overhead
    result = run_in_child(probe_steps, child_spec, timeout=timeout, preload=_preload(spec))
    result["peaks"] = {batch: peak + overhead for batch, peak in result["peaks"].items()}
    return result


def probe_setups_in_child(
    specs: list[dict], batches: list[int], on_setup: Callable[[int, Optional[dict]], None], timeout: float = 900
) -> None:
    """:func:`probe_in_child` of each of ``specs`` at ``batches``, each in a fresh process: ``on_setup(index,
    result)`` as each is done, ``None`` for one that ran out of memory. One process per setup: probed one after
    another in one process, a setup's peaks came out inflated or flat after the one before it (the heap that its
    warm timing steps grew)."""
    for index, spec in enumerate(specs):
        try:
            result = probe_in_child(spec, batches, timeout=timeout)
        except OutOfMemory:
            result = None
        on_setup(index, result)


def device_overhead_in_process(device: str) -> dict[str, Any]:
    """Child-process entry: what a training process holds on ``device`` outside the caching allocator once its CUDA
    context exists (the kernels' modules, the cuBLAS workspace of one matmul) and NCCL has its buffers (a one-rank
    process group and one all-reduce). The device's memory in use is read before the context exists (NVML, through
    ``torch.cuda.device_memory_used``, which creates none) and after; without NVML all of the device's used memory
    counts (other processes' too: the budget then errs on the safe side)."""
    import torch.distributed as torch_dist

    index = torch.device(device).index or 0
    try:
        before = torch.cuda.device_memory_used(index)
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unusable: the whole device's use counts
        before = None
    torch.cuda.set_device(index)
    x = torch.ones(64, 64, device=index)
    (x @ x).sum().item()
    if torch_dist.is_nccl_available():
        torch_dist.init_process_group(
            "nccl", store=torch_dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", index)
        )
        torch_dist.all_reduce(x)
        torch.cuda.synchronize(index)
    free, total = torch.cuda.mem_get_info(index)
    used = total - free if before is None else torch.cuda.device_memory_used(index) - before
    overhead = max(0, used - torch.cuda.memory_reserved(index))
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    return {"overhead": overhead, "nvml": before is not None}


@functools.lru_cache(maxsize=None)
def device_overhead(device: str) -> int:
    """Bytes a process holds on ``device`` besides the memory its allocator reserved (0 on the CPU, whose peak is RSS
    above the bare interpreter), measured once per device, in a fresh child."""
    if torch.device(device).type != "cuda":
        return 0
    return int(run_in_child(device_overhead_in_process, device, timeout=300)["overhead"])


KIT_PARTS = {
    "sdpa": {"sdpa_attention": True},
    "dropout": {"dropout_mask": "regenerate"},
    "layernorm": {"layernorm_saves_output": True},
    "recompute": {"recompute_gelu": True},
    "ffn": {"recompute_gelu": True, "recompute_ffn": True},
    "qkv": {"recompute_qkv": True},
    "bf16gelu": {"bf16_gelu": True},
    "checkpoint": {"checkpoint_every": 1},
    "checkpoint2": {"checkpoint_every": 2},
}
KIT_ALIASES = {
    "exact": ("sdpa", "dropout", "layernorm", "recompute"),
    "all": ("sdpa", "dropout", "layernorm", "recompute", "bf16gelu"),
    "none": (),
}


def variant(
    ratio: float = 0.0, lora: bool = False, kit=(), targets=("auto",), lora_targets=None, preset: Optional[str] = None
) -> dict:
    """A ``wtacrs`` config dict: sampling at ``ratio`` (0: off), LoRA r=8 (on q/v, or ``lora_targets``,
    e.g. ``["auto"]`` for the family's q/v projections), named kit parts (``KIT_PARTS``, ``KIT_ALIASES``),
    or a ``preset`` (then ``ratio`` and ``kit`` add overrides to it)."""
    kit_cfg: dict = {}
    for part in kit:
        for name in KIT_ALIASES.get(part, (part,)):
            kit_cfg.update(KIT_PARTS[name])
    out: dict = {"kit": kit_cfg}
    if preset is not None:
        out["preset"] = preset
    if ratio > 0:
        out.update(enabled=True, ratio=ratio, targets=list(targets))
    if lora:
        out["lora"] = {"enabled": True, **({"targets": list(lora_targets)} if lora_targets else {})}
    return out
