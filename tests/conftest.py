"""Shared fixtures. Tests use real components; process-spawning tests carry timeouts."""

from __future__ import annotations

import json
import os
from itertools import islice
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (the shared data sits beside the checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One ds_bertopt cache for the session: corpora and tokenizers are built once."""
    return tmp_path_factory.mktemp("ds_bertopt_cache")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A real-text jsonl corpus: the first 80 stdlib modules' docstrings."""
    from ds_bertopt.data.corpus import stdlib_docstring_documents

    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for doc in islice(stdlib_docstring_documents(), 80):
            fh.write(json.dumps(doc) + "\n")
    return path


def pytest_sessionstart(session):
    """Build DeepSpeed's CPU shm op once, before any test and outside every per-test timeout: on a fresh machine
    the first process group would otherwise build it (about a minute) inside whichever test comes first."""
    from ds_bertopt.buildlocks import clear_stale_build_locks

    clear_stale_build_locks()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().device_name() == "cpu":
        build_shm_op()


@pytest.fixture(autouse=True)
def _no_stale_build_lock():
    """A test that kills a rank mid-build (a launcher tearing down its job) leaves torch's build lock behind;
    clear it before the next test, which would otherwise wait on it until its timeout."""
    from ds_bertopt.buildlocks import clear_stale_build_locks

    clear_stale_build_locks()
    yield
