"""On a CUDA machine: host syncs of converted tiny models' training steps, seen by CUDA itself.

    python tests/scripts/wtacrs_cuda_sync_check.py          # exit 0: only the documented γ check synced
    python tests/scripts/wtacrs_cuda_sync_check.py --dry-run-cpu    # the same steps on CPU, nothing checked

Runs kit + WTA@0.3 + gradient-norm cache training micro-steps of tiny BERT / ModernBERT / MPNet on
``cuda`` under ``torch.cuda.set_sync_debug_mode("warn")`` and attributes every synchronizing call to
the innermost frame in ``ds_bertopt/wtacrs``. Expected: one sync per optimizer step, in
``GammaGuard._check``, and none in a micro-step without an optimizer step before it. Syncs inside
transformers (its SDPA mask helper reads ``attention_mask.all()``) are listed apart, not failed on.
Without CUDA it says so and exits 0 (the CPU twin is ``tests/test_wtacrs_sync.py``).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from wtacrs_common import tiny_batch, tiny_family  # noqa: E402

OURS = str(Path(__file__).resolve().parents[2] / "ds_bertopt" / "wtacrs")
KIT = {"sdpa_attention": True, "dropout_mask": "regenerate", "layernorm_saves_output": True, "recompute_gelu": True}


def _record_syncs(into: list):
    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if f.filename.startswith(OURS)]
        where = ours[-1] if ours else next((f for f in reversed(frames) if "site-packages" in f.filename), frames[-1])
        into.append(("ours" if ours else "theirs", f"{Path(where.filename).name}:{where.lineno} {where.name}"))

    return show


def check(model_type: str, device: str = "cuda") -> list[str]:
    from ds_bertopt.configlib import load_section
    from ds_bertopt.wtacrs import EXAMPLE_IDS_KWARG, NUM_VALID_ROWS_KWARG, prepare_model
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    raw = {
        "enabled": True,
        "ratio": 0.3,
        "min_k": 4,
        "grad_norm_cache": True,
        "targets": ["ffn_out", "qkv"],
        "kit": KIT,
    }
    model, _ = prepare_model(tiny_family(model_type, dropout=0.1), load_section(WtaCrsConfig, raw, "wtacrs"))
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tiny_batch(batch=4, seq=16, pad_from=11)
    valid = int(batch["attention_mask"].sum())  # counted on the host before the move, as the training loop does
    batch = {key: value.to(device) for key, value in batch.items()}
    batch.update({EXAMPLE_IDS_KWARG: torch.arange(4, device=device), NUM_VALID_ROWS_KWARG: valid})
    model(**batch).loss.backward()  # warm-up (lazy inits)
    optimizer.step()
    if device == "cpu":  # a dry run of the code path (CUDA's sync debug mode does not exist there)
        model(**batch).loss.backward()
        return []
    torch.cuda.synchronize()
    problems, syncs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _record_syncs(syncs)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step, expect in ((0, 1), (1, 0)):  # after an optimizer step: the γ check; then none
                syncs.clear()
                model(**batch).loss.backward()
                ours = [where for who, where in syncs if who == "ours"]
                theirs = sorted({where for who, where in syncs if who == "theirs"})
                print(f"{model_type} micro-step {step}: ours {ours or 'none'}; transformers/torch {theirs or 'none'}")
                if len(ours) != expect or any("_check" not in where for where in ours):
                    problems.append(
                        f"{model_type} micro-step {step}: expected {expect} sync in GammaGuard._check, got {ours}"
                    )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return problems


def main() -> int:
    if "--dry-run-cpu" in sys.argv:
        for model_type in ("bert", "modernbert", "mpnet"):
            check(model_type, "cpu")
        print("dry run on CPU: the steps run; nothing checked")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked (tests/test_wtacrs_sync.py is the CPU check)")
        return 0
    problems = [p for model_type in ("bert", "modernbert", "mpnet") for p in check(model_type)]
    for problem in problems:
        print("FAIL", problem)
    print("ok: the only host sync of ds_bertopt.wtacrs is the documented γ check" if not problems else "")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
