"""WTA-CRS + the memory kit through real ``deepspeed.initialize`` on 2 gloo ranks, ZeRO 0, 2 and 3 (bf16)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ds_bertopt.testing.distributed import free_port, start_processes
import pytest
from _launch import FULL_MATRIX

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import wtacrs_zero_worker  # noqa: E402

KIT = {"sdpa_attention": True, "dropout_mask": "regenerate", "layernorm_saves_output": True, "recompute_gelu": True}


def run_ranks(tmp_path: Path, stage: int, steps: int, wtacrs: dict) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    start_processes(wtacrs_zero_worker.run, (2, free_port(), stage, str(tmp_path), steps, wtacrs), nprocs=2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(240)
# make test: ZeRO 3 (partitioned weights, the hardest); the shipped WTA-CRS configs also run at ZeRO 2 and 3 under the
# launcher in test_finetune. make test-matrix: every stage.
@pytest.mark.parametrize("stage", [0, 2, 3] if FULL_MATRIX else [3])
def test_finetuning_under_zero_learns(tmp_path, stage):
    wtacrs = {
        "enabled": True,
        "ratio": 0.3,
        "min_k": 4,
        "grad_norm_cache": True,
        "targets": ["ffn_out", "qkv"],
        "kit": KIT,
    }
    results = run_ranks(tmp_path, stage, 30, wtacrs)
    for result in results:
        assert result["sampled"] == 2 * 4  # ffn_out and q/k/v of both layers
        losses = result["losses"]
        assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


@pytest.mark.timeout(240)
def test_zero3_ratio_one_matches_unsampled_training(tmp_path):
    """At ratio 1.0 every row is kept with weight 1: ZeRO-3 training must follow the unconverted run."""
    sampled = run_ranks(
        tmp_path / "a", 3, 8, {"enabled": True, "ratio": 1.0, "min_k": 1, "targets": ["ffn_out", "qkv"], "kit": KIT}
    )
    plain = run_ranks(tmp_path / "b", 3, 8, {"enabled": False, "kit": KIT})
    assert sampled[0]["sampled"] == 8 and plain[0]["sampled"] == 0
    for ours, reference in zip(sampled, plain):
        for a, b in zip(ours["losses"], reference["losses"]):
            assert abs(a - b) <= 1e-2 * abs(b) + 1e-3, (ours["losses"], reference["losses"])
