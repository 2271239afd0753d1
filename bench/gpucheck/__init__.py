"""The prepared GPU check behind ``bench/gpu_check.sh`` (never part of CI; see ``docs/gpu_check.md``).

    python bench/gpu_check.py --sections precision memory --budget 200     # on a CUDA machine
    python bench/gpu_check.py --device cpu --tiny                          # smoke run of the logic on a CPU

Each section prints one line ``[gpu_check] <section>: PASS|FAIL|SKIPPED(<reason>) <figures>`` (details:
``[gpu_check]   <section> | ...``); the exit status is 1 iff a section FAILed. What each section checks, how to read
it, and the worker modes (``GPU_CHECK_WORKER``: ``loop``, ``lamb``, ``clip``) its subprocesses run: docs/gpu_check.md.
Runs of the real entry points are subprocesses in their own process group (a timeout kills the whole tree).
"""
