"""``bench/time_to_train.py``'s runs: one contender's launch and wall-time watch, and the yardstick's scoring."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, checkpoint_weights, cpu_env, deepspeed_launcher, maybe_lock, run_streamed
from ds_bertopt.testing.distributed import free_port  # noqa: E402
from bench.time_to_train_setup import (  # noqa: E402
    CONTINUED_HF_SCRIPT,
    HF_CONTENDERS,
    HF_SCRIPT,
    TRAINER_DATA,
    Prepared,
    Scenario,
    hf_data_args,
)


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------
@dataclass
class Run:
    scenario: str
    contender: str
    seed: int
    global_batch: int
    tokens_per_sample: float
    max_steps: int
    """The run's step budget (its LR schedule spans it)."""
    wall_s: float = 0.0
    """Launcher start to exit."""
    save_s: float = 0.0
    """Spent saving snapshots (taken out of every point's time)."""
    steps: list = field(default_factory=list)
    times: list = field(default_factory=list)
    """Seconds from the launcher's start to each snapshot's step, snapshot saving taken out."""
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
        for i, acc in enumerate(self.accuracy):
            if acc >= target:
                if i == 0:
                    return self.times[0], float(self.steps[0])
                a0, a1 = self.accuracy[i - 1], acc
                w = (target - a0) / (a1 - a0) if a1 > a0 else 1.0
                return (
                    self.times[i - 1] + w * (self.times[i] - self.times[i - 1]),
                    self.steps[i - 1] + w * (self.steps[i] - self.steps[i - 1]),
                )
        return None


class OursWatcher(threading.Thread):
    """Polls a run's metrics.jsonl and checkpoints/ every 50 ms: when each train line and each complete checkpoint
    first appears (``time.time()``). A train line is written right after its step, before that step's save."""

    CHECKPOINT = re.compile(r"^step(\d{8})$")

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
        root = self.out / "checkpoints"
        if root.is_dir():
            for name in os.listdir(root):
                match = self.CHECKPOINT.match(name)
                if match:
                    self.checkpoint_seen.setdefault(int(match.group(1)), now)

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.05)
        self.poll()


def ours_args(
    scenario: Scenario, prep: Prepared, overrides: list[str], seed: int, out: Path, every: int, steps: int
) -> list[str]:
    fixed = ["train.keep_last=1000000", "train.save_model=false", "deepspeed.csv_monitor.enabled=false"]
    return argv(
        ROOT / "launch" / "pretrain.py",
        deepspeed_config=scenario.config,
        max_steps=steps,
        output_dir=out,
        overwrite_output_dir=True,
        eval_every=0,
        log_every=every,
        save_every=every,
        seed=seed,
        overrides=[*scenario.data_overrides(), *fixed, *overrides],
    )


def hf_args(
    scenario: Scenario, prep: Prepared, contender: str, seed: int, out: Path, every: int, steps: int
) -> list[str]:
    """A ``Trainer`` run: the HF contenders (transformers' ``Trainer``, ``prep.ds_config``), and in the continued
    scenarios ours through ``BertOptTrainer`` (the scenario's DeepSpeed JSON, whose ``"bertopt"`` section applies)."""
    line_by_line, sampler = TRAINER_DATA.get(contender) or HF_CONTENDERS[contender]
    b, ds = prep.cfg.bertopt, prep.cfg.deepspeed
    opt = b.optimizer
    script = [str(HF_SCRIPT)]
    if scenario.continued:
        from ds_bertopt.model.local import default_model_dir

        trainer = "bertopt" if contender in TRAINER_DATA else "hf"
        script = [str(CONTINUED_HF_SCRIPT), "--model_name_or_path", default_model_dir(), "--trainer", trainer]
    return argv(
        *script,
        *hf_data_args(scenario, prep.cfg, prep.train_docs, prep.tokenizer_dir, prep.train_docs.parent, line_by_line),
        snapshot_every=every,
        snapshot_dir=out / "snapshots",
        timing_file=out / "timing.jsonl",
        deepspeed=scenario.config if contender in TRAINER_DATA else prep.ds_config,
        output_dir=out,
        per_device_train_batch_size=ds["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds.get("gradient_accumulation_steps", 1),
        max_steps=steps,
        learning_rate=repr(opt.lr),  # the baseline's budget
        weight_decay=repr(opt.weight_decay),
        adam_beta1=repr(opt.betas[0]),
        adam_beta2=repr(opt.betas[1]),
        adam_epsilon=repr(opt.eps),
        max_grad_norm=repr(float(ds.get("gradient_clipping", 0.0))),
        lr_scheduler_type="linear",
        warmup_steps=repr(b.schedule.warmup_fraction),
        logging_steps=every,
        save_strategy="no",
        report_to="none",
        disable_tqdm="true",
        dataloader_num_workers=0,
        seed=seed,
        train_sampling_strategy=sampler,
    )


def launch(scenario: Scenario, script_args: list[str], out: Path, timeout: float, net) -> tuple[int, str]:
    """Run ``script_args`` under the deepspeed launcher: one node on loopback, or one launcher per network namespace."""
    from ds_bertopt.testing.netns import remove_deepspeed_shm_buffers

    if scenario.nodes == 1:
        port = free_port()
        cmd = [*deepspeed_launcher(scenario.ranks_per_node, port), *script_args]
        with open(out / "launcher.log", "w") as log:
            try:
                code = run_streamed(cmd, log.write, timeout)
            finally:
                remove_deepspeed_shm_buffers("127.0.0.1", port)  # scripts that never unlink DeepSpeed's shm
        return code, (out / "launcher.log").read_text(errors="replace")
    from ds_bertopt.testing.multinode import run_local_multinode

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
    text = "\n".join(f"--- node {r.node_rank} (exit {r.returncode})\n{r.output}" for r in results)
    (out / "launcher.log").write_text(text)
    return next((r.returncode for r in results if r.returncode), 0), text


def run_one(
    scenario: Scenario,
    prep: Prepared,
    contender: str,
    overrides: Optional[list[str]],
    seed: int,
    points: int,
    timeout: float,
    lock: Optional[str],
    net,
    ours_budget: float,
    resume: bool = False,
) -> Run:
    every = max(1, scenario.steps // points)
    out = prep.work / "runs" / scenario.name / f"{contender}_s{seed}"
    ds = prep.cfg.deepspeed
    world = scenario.nodes * scenario.ranks_per_node
    global_batch = ds["train_micro_batch_size_per_gpu"] * ds.get("gradient_accumulation_steps", 1) * world
    is_hf = contender in HF_CONTENDERS  # the baselines
    by_trainer = is_hf or contender in TRAINER_DATA  # a Trainer script: its snapshots and timing file
    # MLPerf trains until the target; the target is the baseline's final accuracy, so ours may need more steps than the
    # baseline's budget: it gets ``ours_budget`` × as many (the same schedule shape over them), and the crossing counts
    steps = scenario.steps if is_hf else int(round(scenario.steps * ours_budget))
    if by_trainer:
        kind = "line_by_line" if (TRAINER_DATA.get(contender) or HF_CONTENDERS[contender])[0] else "group_texts"
        tokens = prep.hf_stats[kind]["mean_length"]
        args = hf_args(scenario, prep, contender, seed, out, every, steps)
    else:
        tokens = prep.mean_tokens_ours
        # its own output dir: --overwrite_output_dir removes it
        args = ours_args(scenario, prep, overrides or [], seed, out / "train", every, steps)
    # what the run's figures depend on: its command line (overrides, seed, steps, snapshots), bert.json, the yardstick
    identity = [args, scenario.config.read_text(), prep.yardstick_sequences, prep.yardstick_tokens, prep.yardstick_sets]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    record = out / "run_record.json"
    if resume and record.exists():
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
    with maybe_lock(lock):
        if watcher:
            watcher.start()
        started = time.time()
        code, log = launch(scenario, args, out, timeout, net)
        run.wall_s = time.time() - started
        if watcher:
            watcher.stop.set()
            watcher.join()
    if code:
        raise RuntimeError(
            f"{scenario.name} {contender} seed {seed}: exit {code}; log {out / 'launcher.log'}\n{log[-3000:]}"
        )
    snapshots: list[tuple[int, float, Path]] = []
    if by_trainer:
        records = [json.loads(x) for x in (out / "timing.jsonl").read_text().splitlines() if x.strip()]
        saved = 0.0
        for r in records:
            if "save_s" in r:
                path = out / "snapshots" / f"step{r['step']:08d}.pt"
                snapshots.append((r["step"], r["time"] - saved - started, path))
                saved += r["save_s"]
    else:
        saved = 0.0
        for step in sorted(watcher.line_seen):
            if step not in watcher.checkpoint_seen:
                continue
            seen = watcher.line_seen[step]
            snapshots.append((step, seen - saved - started, out / "train" / "checkpoints" / f"step{step:08d}"))
            saved += max(0.0, watcher.checkpoint_seen[step] - seen)
    if not snapshots or snapshots[-1][0] != steps:
        raise RuntimeError(
            f"{scenario.name} {contender} seed {seed}: snapshots at {[s[0] for s in snapshots]}, "
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


# ------------------------------------------------------------------------------------------------
# the common yardstick
# ------------------------------------------------------------------------------------------------
def scoring_model(prep: Prepared):
    """The scenario's masked-LM model as ours builds it (the checkpoint's own architecture in the continued ones)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.config import load_config
    from ds_bertopt.data.tokenizer import load_tokenizer
    from ds_bertopt.model.bert import build_pretraining_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if prep.scenario.continued:  # the checkpoint's own architecture (MiniLM-L6)
        from ds_bertopt.model.local import default_model_dir

        return BertForMaskedLM(BertConfig.from_pretrained(default_model_dir())).eval()
    cfg = load_config(str(prep.scenario.config), prep.scenario.data_overrides()).bertopt
    tokenizer = load_tokenizer(str(prep.tokenizer_dir))
    return build_pretraining_model(cfg.model, tokenizer, cfg.data.max_seq_length).eval()


TIED = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}


def load_snapshot(model, path: Path, hf: bool) -> None:
    """Weights of a Hugging Face snapshot (a state dict) or of our DeepSpeed checkpoint (``module`` of
    ``mp_rank_00_model_states.pt``, our wrapper's ``model.`` prefix removed) into ``model``."""
    import torch

    if hf:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state and all(k.startswith("model.") for k in state):  # BertOptTrainer's wrapper around the HF model
            state = {k[len("model.") :]: v for k, v in state.items()}
    else:
        state = checkpoint_weights(path)
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
            hidden = model.bert(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"],
            ).last_hidden_state
            selected = batch["labels"] != -100
            logits = model.cls(hidden[selected]).float()
            target = batch["labels"][selected]
            correct += int((logits.argmax(-1) == target).sum())
            loss += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            total += int(target.numel())
    return correct / total, loss / total
