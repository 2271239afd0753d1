"""One contender of ``bench/finetune_tasks.py``: ``examples/run_glue.py``, ``run_ner.py`` or ``run_qa.py`` as written
(``BertOptTrainer``: ours) or with transformers' ``Trainer``, under the ``deepspeed`` launcher, measured by a callback.
Each rank writes ``<out>/rank<N>.json``: ``step_s`` (every optimizer step's wall time, step end to step end, the first
from ``on_train_begin``), ``train_s``, ``steps``, ``batch`` (examples per optimizer step, all ranks), ``peak`` (the RSS
high-water mark of training, reset as it begins, above the RSS after the imports) and ``eval`` (the script's scores).

    deepspeed --num_gpus 2 bench/finetune_tasks_run.py --task glue --trainer hf --out DIR -- <script arguments>
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]

import deepspeed  # noqa: E402,F401  - import cost belongs to the bare RSS, not the training
import torch  # noqa: E402
import transformers  # noqa: E402

from ds_bertopt.integrations.hf import BertOptTrainer  # noqa: E402
from ds_bertopt.wtacrs.memory import _proc_status_kib, _reset_peak  # noqa: E402

BARE_KIB = _proc_status_kib("VmRSS")


class Meter(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.step_s: list[float] = []
        self.exact_peak = _reset_peak()  # /proc/self/clear_refs
        self.begin = self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()  # step to step: loading and collating the batches included
        self.step_s.append(now - self.last)
        self.last = now

    def on_train_end(self, args, state, control, **kwargs):
        self.train_s = time.perf_counter() - self.begin
        self.peak = (_proc_status_kib("VmHWM") - BARE_KIB) * 1024


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("glue", "ner", "qa"), required=True)
    parser.add_argument("--trainer", choices=("hf", "ours"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args, script_argv = parser.parse_known_args(argv)
    script, meter = importlib.import_module(f"run_{args.task}"), Meter()
    trainer_class = BertOptTrainer if args.trainer == "ours" else transformers.Trainer
    built = script.build_trainer(script_argv, trainer_class=trainer_class, callbacks=[meter])
    trainer, evaluation = built if isinstance(built, tuple) else (built, None)
    trainer.train()
    if evaluation is not None:
        scores = script.evaluate(trainer, evaluation)
    else:
        scores = {k.removeprefix("eval_"): v for k, v in trainer.evaluate().items()}
    training = trainer.args
    result = {"step_s": meter.step_s, "train_s": meter.train_s, "steps": trainer.state.global_step}
    result["batch"] = training.per_device_train_batch_size * training.gradient_accumulation_steps * training.world_size
    result.update(peak=meter.peak, exact_peak=meter.exact_peak, eval=scores, threads=torch.get_num_threads())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{training.process_index}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # a clean exit: gloo's threads torn down before the interpreter's
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
