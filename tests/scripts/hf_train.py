"""Started by tests/test_hf_integration.py under the deepspeed or accelerate launcher.

Builds the trainer of ``examples/run_classification.py`` from its command-line arguments (pass ``--eval_on_start
true``: under ZeRO 0-2 Trainer can evaluate only once the engine exists), trains, evaluates again, saves the model
to ``--output_dir``, and on rank 0 writes what the test checks to the JSON file named by ``DS_BERTOPT_HF_RESULT``:
eval loss before and after; the SampledLinear count and cache fill of the trained model; its saved-for-backward
bytes on the fixed batch (seeded: the test repeats the measurement on the saved weights converted by
``prepare_model`` and expects the same bytes); whether ``"bertopt"`` reached DeepSpeed; the engine's optimizer,
gradient clipping and bucket-clip hook; the logged learning rates.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(Path(__file__).resolve().parent)]


def main(argv: list[str]) -> None:
    from hf_common import saved_bytes_on_fixed_batch
    from run_classification import build_trainer

    from ds_bertopt.wtacrs import SampledLinear

    trainer = build_trainer(argv)
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    before = next(r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r)
    trainer.save_model()
    if not trainer.is_world_process_zero():
        return
    model, engine = trainer.model, trainer.model_wrapped
    sampled = [m for m in model.modules() if isinstance(m, SampledLinear)]
    caches = [m.cache for m in sampled if m.cache is not None]
    result = {
        "eval_loss_before": before,
        "eval_loss_after": after,
        "world_size": trainer.args.world_size,
        "zero_stage": engine.zero_optimization_stage(),
        "engine": type(engine).__name__,
        "sampled": len(sampled),
        "cached_examples": max((int((c.tags >= 0).sum()) for c in caches if c.tags is not None), default=0),
        "bertopt_in_engine_config": "bertopt" in engine.config,
        "bertopt_in_plugin_config": "bertopt" in trainer.accelerator.state.deepspeed_plugin.deepspeed_config,
        "saved": saved_bytes_on_fixed_batch(model, trainer.processing_class),
        "client_optimizer": type(engine.client_optimizer).__name__,
        "gradient_clipping": engine.gradient_clipping(),
        "bucket_clip": getattr(engine, "bucket_clip", None) is not None,
        "learning_rates": [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r],
        "train_losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
    }
    Path(os.environ["DS_BERTOPT_HF_RESULT"]).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
