"""A minimal ``run_mlm.py``-style masked-LM pretraining script: Hugging Face ``Trainer`` + DeepSpeed, nothing of ours
in the training path. ``bench/time_to_train.py`` runs it under the real ``deepspeed`` launcher as the baseline.

What a ``run_mlm.py`` user runs, written out (not copied from transformers' example):

* the corpus: a jsonl (``--text_column``) loaded with ``datasets.load_dataset("json")``;
* tokenisation with a given tokenizer (``--tokenizer_name``), then either
  - default: ``group_texts``: every document tokenised with its ``[CLS]``/``[SEP]``, all of it concatenated and cut
    into blocks of exactly ``--max_seq_length`` tokens (across document boundaries; the remainder dropped): no
    padding at all; or
  - ``--line_by_line``: every non-empty line of every document is one example, truncated at ``--max_seq_length``,
    padded per batch by the collator (use ``--train_sampling_strategy group_by_length`` or ``batch_rebalance``);
* ``DataCollatorForLanguageModeling`` (15 %, 80/10/10), a randomly initialised ``BertForMaskedLM`` of the given size
  (``--hidden_size`` …, vocabulary = the tokenizer's), ``Trainer`` with ``TrainingArguments(deepspeed=...)``.

The only addition is measurement, kept out of the step: :class:`SnapshotCallback` saves the weights every
``--snapshot_every`` steps (and at the last) to ``--snapshot_dir`` and appends ``{"step", "time", "save_s"}`` to
``--timing_file`` (rank 0, ``time.time()``), so a scorer can put every snapshot on a wall-clock axis with the save
time taken out. ``--prepare_only`` builds the tokenised dataset (``datasets`` caches it) and writes its statistics
to ``--stats_file``, without training.

On a CPU-only host ``ds_bertopt.integrations.hf.cpu_deepspeed_argv`` works around accelerate 1.15 counting one
process under DeepSpeed (see docs/hf.md); it changes nothing else.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "jsonl corpus, one document per line"})
    tokenizer_name: str = field(metadata={"help": "tokenizer directory (a BERT WordPiece tokenizer)"})
    text_column: str = field(default="text")
    max_seq_length: int = field(default=128)
    line_by_line: bool = field(default=False, metadata={"help": "one example per non-empty line (else group_texts)"})
    mlm_probability: float = field(default=0.15)
    hidden_size: int = field(default=128)
    num_hidden_layers: int = field(default=2)
    num_attention_heads: int = field(default=2)
    intermediate_size: int = field(default=512)
    max_position_embeddings: int = field(default=512)
    hidden_dropout_prob: float = field(default=0.1)
    attention_probs_dropout_prob: float = field(default=0.1)
    snapshot_every: int = field(default=0, metadata={"help": "save the weights every N steps (0: only at the end)"})
    snapshot_dir: Optional[str] = field(default=None)
    timing_file: Optional[str] = field(default=None)
    prepare_only: bool = field(default=False, metadata={"help": "tokenise (cached by datasets) and exit"})
    stats_file: Optional[str] = field(default=None, metadata={"help": "with --prepare_only: dataset statistics"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "datasets cache directory"})


def is_main() -> bool:
    return int(os.environ.get("RANK", "0") or 0) == 0


def build_dataset(script: ScriptArguments, tokenizer, training_args):
    from datasets import load_dataset

    raw = load_dataset("json", data_files={"train": script.train_file}, cache_dir=script.cache_dir)["train"]
    text = script.text_column
    drop = raw.column_names
    if script.line_by_line:

        def tokenize_lines(batch):
            lines = [line for doc in batch[text] for line in doc.splitlines() if line.strip()]
            return tokenizer(lines, truncation=True, max_length=script.max_seq_length, return_special_tokens_mask=True)

        with training_args.main_process_first(desc="tokenizing lines"):
            return raw.map(tokenize_lines, batched=True, remove_columns=drop, desc="tokenizing lines")

    block = script.max_seq_length

    def tokenize_documents(batch):
        return tokenizer(batch[text], return_special_tokens_mask=True)

    def group_texts(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block) * block  # the remainder of each map batch is dropped
        return {k: [v[i : i + block] for i in range(0, total, block)] for k, v in joined.items()}

    with training_args.main_process_first(desc="tokenizing documents, grouping texts"):
        tokenized = raw.map(tokenize_documents, batched=True, remove_columns=drop, desc="tokenizing documents")
        return tokenized.map(group_texts, batched=True, desc=f"grouping texts in blocks of {block}")


class SnapshotCallback(TrainerCallback):
    """Weights every ``every`` steps and at the last; one timing line per snapshot (rank 0)."""

    def __init__(self, every: int, directory: Optional[str], timing_file: Optional[str]):
        super().__init__()
        self.every, self.directory, self.timing_file = every, directory, timing_file

    def _write(self, record: dict) -> None:
        if self.timing_file and is_main():
            with open(self.timing_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._write({"event": "train_begin", "time": time.time()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import torch

        step = state.global_step
        if not (step == state.max_steps or (self.every and step % self.every == 0)):
            return
        now = time.time()
        if self.directory and is_main() and model is not None:
            os.makedirs(self.directory, exist_ok=True)
            weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
            torch.save(weights, os.path.join(self.directory, f"step{step:08d}.pt"))
        self._write({"step": step, "time": now, "save_s": time.time() - now})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._write({"step": state.global_step, "loss": logs["loss"], "log_time": time.time()})


def main(argv: list[str]) -> int:
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        HfArgumentParser,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from ds_bertopt.integrations.hf import cpu_deepspeed_argv

    argv = cpu_deepspeed_argv(argv)  # CPU-only hosts: accelerate's process count under DeepSpeed (docs/hf.md)
    script, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name)
    dataset = build_dataset(script, tokenizer, training_args)
    if script.prepare_only:
        if script.stats_file and is_main():
            lengths = [len(ids) for ids in dataset["input_ids"]]
            Path(script.stats_file).write_text(
                json.dumps(
                    {
                        "examples": len(lengths),
                        "tokens": int(sum(lengths)),
                        "mean_length": sum(lengths) / max(1, len(lengths)),
                        "max_length": max(lengths, default=0),
                    }
                ),
                encoding="utf-8",
            )
        return 0

    set_seed(training_args.seed)  # the model's initialisation, as run_mlm.py does before building the model
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=script.hidden_size,
        num_hidden_layers=script.num_hidden_layers,
        num_attention_heads=script.num_attention_heads,
        intermediate_size=script.intermediate_size,
        max_position_embeddings=script.max_position_embeddings,
        hidden_dropout_prob=script.hidden_dropout_prob,
        attention_probs_dropout_prob=script.attention_probs_dropout_prob,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = BertForMaskedLM(config)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=script.mlm_probability)

    snapshot = SnapshotCallback(script.snapshot_every, script.snapshot_dir, script.timing_file)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[snapshot],
    )
    if is_main():
        print(
            f"[hf_mlm] {len(dataset)} training examples ({'line by line' if script.line_by_line else 'group_texts'}, "
            f"seq {script.max_seq_length}); BertForMaskedLM {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
            f"parameters; world {training_args.world_size}; sampler {training_args.train_sampling_strategy}",
            flush=True,
        )
    result = trainer.train()
    if is_main():
        print(f"[hf_mlm] done: {result.global_step} steps, train loss {result.training_loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
