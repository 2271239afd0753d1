"""Helpers for tests/ and bench/ (real gloo ranks, simulated nodes and namespaces, the GPU conformance rows, timing).

Users never import them, and no production module does (the ``testing`` contract in .importlinter). They still
ship inside the package because every test, every benchmark and bench/gpu_check.sh (run from a bare checkout on a
GPU machine) imports them as ``ds_bertopt.testing``; moving them to a top-level package is a mechanical change of
every one of those imports, left until the work in flight on those files has merged (issue 41).
"""
