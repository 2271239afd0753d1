"""Entry point of the prepared GPU check (``bench/gpu_check.sh``; the code is the ``bench/gpucheck`` package).

    python bench/gpu_check.py --sections precision memory --budget 200     # on a CUDA machine
    python bench/gpu_check.py --device cpu --tiny                          # smoke run of the logic on a CPU

Also the worker the check's subprocesses run (``GPU_CHECK_WORKER`` set): see ``bench/gpucheck/__init__.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpucheck.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
