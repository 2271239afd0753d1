"""What a CUDA run executes, run on the CPU with DeepSpeed's own classes (docs/gpu_matrix.md).

Each row of the matrix is a combination a GPU user may configure (precision × optimizer × ZeRO stage ×
offload_optimizer × overlap_comm). ``ds_bertopt.testing.gpu_paths.cuda_choice`` says which optimizer we build and
which wrapper DeepSpeed then picks on CUDA; every row the CPU can construct is run on 2 gloo ranks with exactly that
class (DeepSpeed's ``FusedAdam``, with its CUDA kernel done in torch, so DeepSpeed takes the fused branches): two
steps with the bucket clip active and LAMB's ZeRO attachment, a NaN step that must be skipped, and checkpoint +
resume that must reproduce step 2 exactly. The rows refused by the pre-flight are checked to be refused in one
line. ``make test`` runs the representative rows (``gpu_paths.REPRESENTATIVE``); ``make test-matrix`` every row.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from _launch import FULL_MATRIX  # noqa: E402
from conformance_worker import row_config, run_rows  # noqa: E402

from ds_bertopt.compat import deepspeed as ds_compat  # noqa: E402
from ds_bertopt.errors import ConfigError  # noqa: E402
from ds_bertopt.testing.distributed import spawn_ranks  # noqa: E402
from ds_bertopt.testing.gpu_paths import (  # noqa: E402
    REPRESENTATIVE,
    Row,
    all_rows,
    cpu_rows,
    conformance_problems,
    cuda_choice,
    markdown_table,
    reference_row,
)

REPO = Path(__file__).resolve().parents[1]
FULL = FULL_MATRIX
ROWS = cpu_rows() if FULL else list(REPRESENTATIVE)
WORLD = 2


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every selected row on the same 2 gloo ranks, one after the other: (workdir, per-rank results by row id)."""
    workdir = tmp_path_factory.mktemp("conformance")
    return workdir, spawn_ranks(run_rows, WORLD, ROWS, str(workdir), timeout=1800 if FULL else 600)


def refused_hooks(row) -> list[str]:
    """The hooks this row needs (bucket clip on, LAMB attached) that the installed DeepSpeed lacks: the row must be
    refused before training, in one line naming the first (docs/compat.md)."""
    needed = ds_compat.needed_hooks(
        stage=row.stage,
        precision=row.precision,
        bucket_clip=row.stage < 3,
        lamb=row.optimizer == "lamb",
        offload=row.offload,
    )
    return [h for h in needed if not ds_compat.available(h) and ds_compat.hook(h).when_missing == "refuse"]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_row_trains_checkpoints_and_resumes_with_deepspeeds_cuda_classes(matrix, row):
    _, results = matrix
    refused = refused_hooks(row)
    for rank, by_row in enumerate(results):
        if refused:
            error = by_row[row.id].get("error", "")
            assert error.startswith("DeepSpeedIncompatible") and f"hook {refused[0]} " in error, (rank, error)
            continue
        problems = conformance_problems(row, by_row[row.id])
        assert not problems, f"rank {rank}: {problems}"


COMPARED = [row for row in ROWS if reference_row(row) in ROWS]


@pytest.mark.parametrize("row", COMPARED, ids=lambda r: r.id)
def test_row_takes_the_steps_zero0_takes(matrix, row):
    """ZeRO 1/2, offload and overlap_comm change where the steps are computed, never what they are."""
    workdir, _ = matrix
    for refused in (row, reference_row(row)):
        if refused_hooks(refused):  # asserted to be refused by the test above
            pytest.skip(f"{refused.id} is refused by DeepSpeed {ds_compat.version()} ({refused_hooks(refused)[0]})")
    got = torch.load(workdir / f"{row.id}.params.pt")
    want = torch.load(workdir / f"{reference_row(row).id}.params.pt")
    assert all(torch.equal(got["initial"][n], want["initial"][n]) for n in want["initial"]), "not the same start"
    # Gradients are summed in another order, and Adam turns an element whose gradient is near eps into a visibly
    # different update: in fp32 one element of an update can move by a few 1e-5 of itself (seen on an AVX512 CPU),
    # in bf16 by much more. The updates as a whole must agree: a wrong clip, average or bias correction moves them by
    # 10 % or more (e.g. 26 % for a bias correction off by one step); fp32's reduction order alone moves them by ~1e-7.
    moved = [got["after_step2"][n] - got["initial"][n] for n in want["initial"]]
    expected = [want["after_step2"][n] - want["initial"][n] for n in want["initial"]]
    error = sum(float((m - e).abs().sum()) for m, e in zip(moved, expected))
    size = sum(float(e.abs().sum()) for e in expected)
    tolerance = 1e-4 if row.precision == "fp32" else 0.02
    assert error <= tolerance * size, f"{row.id}: its updates differ from ZeRO 0's by {error / size:.2g} of them"


REFUSED = [row for row in all_rows() if cuda_choice(row).refusal]


@pytest.mark.parametrize("row", REFUSED, ids=lambda r: r.id)
def test_refused_rows_stop_in_the_preflight_with_one_line(row):
    with pytest.raises(ConfigError) as caught:
        row_config(row, "cuda", WORLD)
    message = str(caught.value)
    assert message.startswith(cuda_choice(row).refusal) and "\n" not in message, message


def test_fp16_rows_pass_the_preflight_on_cuda_and_are_refused_on_cpu():
    for row in (r for r in all_rows() if r.precision == "fp16" and not cuda_choice(r).refusal):
        refused = refused_hooks(row)
        if refused:  # the installed DeepSpeed lacks a hook the row needs: refused in the pre-flight, in one line
            with pytest.raises(ds_compat.DeepSpeedIncompatible, match=f"hook {re.escape(refused[0])} "):
                row_config(row, "cuda", WORLD)
            continue
        assert row_config(row, "cuda", WORLD).deepspeed["fp16"] == {"enabled": True}
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU"):
        row_config(Row("fp16", "adamw", 0), "cpu", WORLD)


def test_docs_hold_the_matrix():
    text = (REPO / "docs" / "gpu_matrix.md").read_text(encoding="utf-8")
    assert markdown_table() in text, "docs/gpu_matrix.md differs from gpu_paths.cuda_choice: regenerate it"
