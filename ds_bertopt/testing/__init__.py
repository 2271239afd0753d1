"""Helpers for tests/ and bench/ (real gloo ranks, simulated nodes and namespaces, the GPU conformance rows, timing).

No production module imports them (the ``testing`` contract in .importlinter). Why they ship inside the package:
- one is a user's tool: ``multinode`` simulates an N-node hostfile job on one machine (``launch/local_multinode.sh``,
  README "Multi-node");
- the rank scripts of the tests (``tests/scripts/*_worker.py``) import them in every process a launcher starts:
  ``deepspeed``, ``torchrun``, ``accelerate launch``, one launcher per simulated node, ``ip netns exec``. The
  installed package is importable in all of those; a top-level folder would need ``PYTHONPATH`` carried through
  each of them;
- ``bench/gpu_check.sh`` runs the same conformance rows (``gpu_paths``) and apex's kernel arithmetic (``apex_lamb``)
  on a GPU machine from a bare checkout, as the tests run them here: one copy, not two.
"""
