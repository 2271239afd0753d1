"""The prepared GPU check behind ``bench/gpu_check.sh`` (never part of CI; see ``docs/gpu_check.md``).

    python bench/gpu_check.py --sections precision memory --budget 200     # on a CUDA machine
    python bench/gpu_check.py --device cpu --tiny                          # smoke run of the logic on a CPU

Sections (each prints exactly one line ``[gpu_check] <section>: PASS|FAIL|SKIPPED(<reason>) <figures>``,
detail lines read ``[gpu_check]   <section> | ...``; the exit status is 1 iff a section FAILed):

* ``precision``  — bf16/fp16 pretraining (``launch/pretrain.py``, ``ds_configs/bert.json``) with the bucket-clip
  hook at ZeRO 0/1/2, and LAMB at ZeRO 0/2; every run exits 0, its loss is finite and falls.
* ``lamb_equal`` — ``tests/scripts/optim_zero_check.py`` on the accelerator: ZeRO-1/2 LAMB takes ZeRO-0's steps,
  resume is bit-exact, bf16 through DeepSpeed's wrappers; the tolerances of ``tests/test_optim_zero.py``. Where apex
  is installed, its ``FusedLAMB`` as we build it takes our LAMB's step (``apex_lamb.py``).
* ``resume``     — a reference run vs a run killed mid-way (fault injector) and ``--resume``d: final weights,
  per-step losses and samples, bit-exact or the largest difference.
* ``wtacrs``     — the sampled linear's fp32/bf16/fp16 paths: unbiased weight gradient over draws, no host sync,
  finite fp16 (GradScaler) and bf16 (autocast) training steps of a kit + WTA-CRS BERT.
* ``memory``     — ``torch.cuda.max_memory_allocated`` of one fine-tuning step: full, HF activation checkpointing,
  kit + WTA@0.3, LoRA + kit, kit + WTA + checkpointing; MiniLM-L6 and BERT-base; 64×128 and 32×512; fp32, bf16.
* ``syncs``      — host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``) of the real loop: pretraining
  padded / unpadded and fine-tuning with kit + WTA, attributed to the innermost frame outside torch.
* ``unpadded``   — packed attention ``varlen`` vs ``sdpa_loop`` (bf16/fp16, forward + backward, dropout), and
  tokens/s of unpadded vs padded BERT-base steps on a wide length mix (seq 512).
* ``nccl``       — (>= 2 GPUs) 2-rank start-up through the deepspeed launcher, resume across 2 ranks, ZeRO-2 LAMB =
  ZeRO-0 LAMB on 2 ranks, bucket-clip hook vs DeepSpeed clipping step time.

Runs of the real entry points are subprocesses (their own process group: a timeout kills the whole tree).
The same entry point is also the worker those subprocesses run when ``GPU_CHECK_WORKER`` is set (``loop``: a task's
``main`` with the sync counter / device probe patched in from here, nothing in ds_bertopt edited; ``lamb``:
the optimizer checks on the accelerator; ``clip``: the 2-rank bucket-clip timing).
"""
