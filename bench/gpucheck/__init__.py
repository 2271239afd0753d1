"""The prepared GPU check behind ``bench/gpu_check.sh`` (never part of CI): what each section checks, how to read its
``[gpu_check]`` lines and the worker modes its subprocesses run (``GPU_CHECK_WORKER``): docs/gpu_check.md."""
