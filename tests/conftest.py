"""Shared fixtures. Tests use real components; process-spawning tests carry timeouts."""

from __future__ import annotations

import contextlib
import json
import sys
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
    session.config.shm_buffers_before = set(_deepspeed_shm_buffers())


def _deepspeed_shm_buffers() -> list[str]:
    stem = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(stem)] if os.path.isdir("/dev/shm") else []


def pytest_sessionfinish(session):
    """Remove DeepSpeed's CPU allreduce buffers this session's jobs left in /dev/shm (a rank killed on purpose never
    reaches ``release_shm_buffer``), unless a live process still maps one: each is ~66 MB of RAM until reboot, and a
    suite's worth fills /dev/shm."""
    before = getattr(session.config, "shm_buffers_before", None)
    if before is None:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped.update(line.rsplit("/", 1)[1] for line in maps.read_text().splitlines() if "/dev/shm/" in line)
    for name in set(_deepspeed_shm_buffers()) - before - mapped:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))


CHECKOUT_RUNS = REPO / "runs"
"""Where the README's ``make pretrain`` writes (``train.output_dir`` defaults to ``runs/<config>``): no test may read
or write it, so that ``make pretrain`` followed by ``make test`` passes."""


def _inside(path, root: Path) -> bool:
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    return path == root or root in path.parents


def _snapshot(root: Path):
    if not root.exists():
        return None
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in [root, *root.rglob("*")])


def _refuse_the_checkout(path) -> None:
    if _inside(path, CHECKOUT_RUNS):
        pytest.fail(f"the test used the checkout's {path} (a default path); give it a temporary --output_dir")


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch):
    """A test that reads the checkout's ``runs/`` (judges or resumes an output directory there, in this process) fails
    at once; one that changed it (in any process: a launcher's run) fails when it ends. Tests pass a temporary
    ``--output_dir``."""
    from ds_bertopt.train import checkpoint, rundir

    entries, resume_dir = rundir.entries, checkpoint.resolve_resume_dir

    def guarded_entries(output_dir):
        _refuse_the_checkout(output_dir)
        return entries(output_dir)

    def guarded_resume_dir(resume, output_dir):
        _refuse_the_checkout(output_dir if resume == "auto" else resume)
        return resume_dir(resume, output_dir)

    monkeypatch.setattr(rundir, "entries", guarded_entries)
    monkeypatch.setattr(checkpoint, "resolve_resume_dir", guarded_resume_dir)
    before = _snapshot(CHECKOUT_RUNS)
    yield
    if _snapshot(CHECKOUT_RUNS) != before:
        pytest.fail(
            f"the test changed the checkout's {CHECKOUT_RUNS} (a default path); give it a temporary --output_dir"
        )


@pytest.fixture(autouse=True)
def _no_stale_build_lock():
    """A test that kills a rank mid-build (a launcher tearing down its job) leaves torch's build lock behind;
    clear it before the next test, which would otherwise wait on it until its timeout."""
    from ds_bertopt.buildlocks import clear_stale_build_locks

    clear_stale_build_locks()
    yield


def pytest_terminal_summary(terminalreporter):
    """The count of generated bad-input cases (tests/test_bad_input_generated.py), when it ran."""
    module = sys.modules.get("test_bad_input_generated")
    if module is not None:
        counts = module.generated_count()
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        terminalreporter.write_line(f"bad input: {sum(counts.values())} generated cases ({kinds})")
