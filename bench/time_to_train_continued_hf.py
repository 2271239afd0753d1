"""The ``Trainer`` runs of ``bench/time_to_train.py``'s continued scenarios: ``tests/scripts/hf_mlm_train.py``'s data,
snapshots and timing, from a released checkpoint instead of a random model, under transformers' ``Trainer`` (``--trainer
hf``: the baselines) or ``BertOptTrainer`` (``--trainer bertopt``: ours, with the DeepSpeed JSON's ``"bertopt"``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser
from transformers import Trainer, TrainingArguments, set_seed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv
from hf_mlm_train import ScriptArguments, SnapshotCallback, build_dataset, is_main


@dataclass
class ContinuedArguments:
    model_name_or_path: str = field(metadata={"help": "the checkpoint directory training continues from"})
    trainer: str = field(default="hf", metadata={"choices": ("hf", "bertopt"), "help": "hf: Trainer; bertopt: ours"})


def main(argv: list[str]) -> int:
    parser = HfArgumentParser((ScriptArguments, ContinuedArguments, TrainingArguments))
    script, continued, training_args = parser.parse_args_into_dataclasses(cpu_deepspeed_argv(argv))
    tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name)
    dataset = build_dataset(script, tokenizer, training_args)
    set_seed(training_args.seed)  # the new MLM head's initialisation, as run_mlm.py seeds before building the model
    model = AutoModelForMaskedLM.from_pretrained(continued.model_name_or_path)
    trainer_class = BertOptTrainer if continued.trainer == "bertopt" else Trainer
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=script.mlm_probability)
    snapshots = SnapshotCallback(script.snapshot_every, script.snapshot_dir, script.timing_file)
    parts = {"data_collator": collator, "processing_class": tokenizer, "callbacks": [snapshots]}
    trainer = trainer_class(model=model, args=training_args, train_dataset=dataset, **parts)
    if is_main():
        print(
            f"[continued] {trainer_class.__name__} from {continued.model_name_or_path}: {len(dataset)} training "
            f"examples ({'line by line' if script.line_by_line else 'group_texts'}, seq {script.max_seq_length}); "
            f"world {training_args.world_size}",
            flush=True,
        )
    result = trainer.train()
    if is_main():
        print(f"[continued] done: {result.global_step} steps, train loss {result.training_loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
