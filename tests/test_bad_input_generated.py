"""Bad input as a class: cases generated from the config dataclasses and the command line, not listed by hand.

For every field of the ``"bertopt"`` section (``configlib.iter_fields``): a value of the wrong type; a value out of
range wherever the section's ``__post_init__`` bounds it (found by asking the section); and the field set while
another setting makes it dead (found by asking ``dead_fields()`` under the built-in config and every single switch:
each bool flipped, each choice, each empty optional given). For every path argument (config fields that are paths,
``--deepspeed_config``, ``--resume``, the subcommands' paths): missing, a file where a directory is expected and the
reverse, unreadable, not creatable. Each must end in exit status 2 and one ``error:`` line naming the field or the
path, with nothing written. They run in-process through the entry points' ``main`` (the pre-flight), a handful
through the real launcher; the count is printed in the session summary (``tests/conftest.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest

from _permissions import permissions_apply

from ds_bertopt.cli import main as cli_main
from ds_bertopt.config import BertOptConfig, RunConfig, dead_keys
from ds_bertopt.configlib import iter_fields, load_section, set_dotted, to_dict
from ds_bertopt.errors import ConfigError
from ds_bertopt.train.preflight import unread_keys
from ds_bertopt.train.tasks import FinetuneTask, PretrainTask
from ds_bertopt.train.tasks.finetune import main as finetune_main
from ds_bertopt.train.tasks.pretrain import main as pretrain_main

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {key: (tp, default) for key, tp, default, _ in iter_fields(BertOptConfig)}
DEEPSPEED = {"train_micro_batch_size_per_gpu": 2}
DEEPSPEED_SWITCHES = {"deepspeed.bf16": {"enabled": True}}
"""Settings of DeepSpeed's part that make keys of ours dead (``BertOptConfig.dead_fields``)."""


def task_of(key: str) -> str:
    return "pretrain" if not unread_keys({key}, PretrainTask.reads) else "finetune"


def _inner(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def wrong_type(tp: Any) -> Any:
    """A JSON value no annotation ``tp`` accepts."""
    tp = _inner(tp)
    origin = get_origin(tp)
    if origin is Literal:
        return 7 if isinstance(get_args(tp)[0], str) else "seven"
    if origin in (tuple, list):
        return 5
    return {bool: 3, int: "ten", float: "x", str: 5}[tp]


def out_of_range_candidates(tp: Any) -> list:
    tp = _inner(tp)
    if get_origin(tp) in (tuple, list):
        args = get_args(tp)
        if args[0] is int:
            return [[0], [2, 1]]
        if args[0] is float:
            return [[1.5] * len(args), [-0.5] * len(args)]
        return [[]]
    return {int: [0, -1], float: [-1.0, 0.0, 1.5], str: [""]}.get(tp, [])


def _nested(pairs: dict) -> dict:
    raw: dict = {}
    for key, value in pairs.items():
        set_dotted(raw, key, value)
    return raw


def _section_refuses(key: str, value: Any) -> bool:
    try:
        load_section(BertOptConfig, _nested({key: value}), "bertopt")
    except ConfigError:
        return True
    return False


def _sample(key: str) -> Any:
    """A valid value for a field that is empty by default (an optional, an empty list)."""
    inner = _inner(FIELDS[key][0])
    if get_origin(inner) is Literal:
        return get_args(inner)[0]
    if get_origin(inner) is tuple:
        return [128] if get_args(inner)[0] is int else ["x"]
    return {int: 4, float: 0.5, str: "some/path"}[inner]


def _switches() -> list[dict]:
    """The built-in config and every single switch away from it."""
    out: list[dict] = [{}]
    for key, (tp, default) in FIELDS.items():
        inner = _inner(tp)
        if inner is bool:
            out.append({key: not default})
        elif get_origin(inner) is Literal:
            out += [{key: v} for v in get_args(inner) if v != default]
        elif default is None or default == ():
            out.append({key: _sample(key)})
    return out + [dict([item]) for item in DEEPSPEED_SWITCHES.items()]


def _dead_under(switch: dict) -> dict[str, str]:
    ours = {k: v for k, v in switch.items() if not k.startswith("deepspeed.")}
    ds = {**DEEPSPEED, **{k[len("deepspeed.") :]: v for k, v in switch.items() if k.startswith("deepspeed.")}}
    try:
        bertopt = load_section(BertOptConfig, _nested(ours), "bertopt")
    except ConfigError:
        return {}
    return dead_keys(RunConfig(path="", deepspeed=ds, bertopt=bertopt))


def _own_values(key: str) -> list:
    """The values of a bool or choice field other than its default (a rule may depend on the field's own value)."""
    tp, default = FIELDS[key]
    inner = _inner(tp)
    if inner is bool:
        return [not default]
    return [v for v in get_args(inner) if v != default] if get_origin(inner) is Literal else []


def dead_cases() -> list[tuple[str, dict, Any, str]]:
    """``(key, switch, value, task)``: the first switch under which ``key`` set to ``value`` (its default, or for a
    rule on DeepSpeed's part any of its choices) is dead, the switch's own keys live, and the task that reads
    ``key`` and the switch's keys."""
    found: dict[str, tuple[dict, Any]] = {}
    for switch in _switches():
        trials = [(switch, None)]
        if any(k.startswith("deepspeed.") for k in switch):
            trials += [({**switch, key: v}, key) for key in FIELDS for v in _own_values(key)]
        for trial, tried in trials:
            dead = _dead_under(trial)
            own = {k for k in trial if not k.startswith("deepspeed.") and k != tried}
            if own & set(dead):
                continue
            for key in dead:
                task = task_reading(key, own)
                if tried not in (None, key) or key in found or task is None:
                    continue
                found[key] = (trial, trial[key] if tried else _dead_value(trial, key), task)
    return sorted(
        (key, {k: v for k, v in s.items() if k != key}, value, task) for key, (s, value, task) in found.items()
    )


def task_reading(key: str, own: set) -> str | None:
    """The task that reads ``key`` and every key of ``own`` (``train.eval_every`` under ``finetune.train_file``: the
    fine-tuning task), preferring :func:`task_of`'s; None where no task reads them all."""
    tasks = sorted(TASK_READS, key=lambda name: name != task_of(key))
    return next((name for name in tasks if not unread_keys({key, *own}, TASK_READS[name])), None)


def _dead_value(switch: dict, key: str) -> Any:
    """What to set ``key`` to: a real value where its default is empty (when that stays dead), else its default."""
    default = to_dict(FIELDS[key][1])
    if default in (None, []) and key in _dead_under({**switch, key: _sample(key)}):
        return _sample(key)
    return default


TASK_READS = {"pretrain": PretrainTask.reads, "finetune": FinetuneTask.reads}


def _override(key: str, value: Any) -> list[str]:
    return ["-o", f"{key}={json.dumps(value)}"]


def config_cases() -> list:
    cases = []
    for key, (tp, _) in FIELDS.items():
        cases.append(pytest.param(key, _override(key, wrong_type(tp)), task_of(key), id=f"type-{key}"))
        refused = [v for v in out_of_range_candidates(tp) if _section_refuses(key, v)]
        if refused:
            cases.append(pytest.param(key, _override(key, refused[0]), task_of(key), id=f"range-{key}"))
    for key, switch, value, task in dead_cases():
        argv = [a for k, v in switch.items() for a in _override(k, v)]
        argv += _override(key, value)  # set at all (its default where that is dead too), it cannot matter
        cases.append(pytest.param(key, argv, task, id=f"dead-{key}"))
    return cases


CONFIG_CASES = config_cases()


@pytest.fixture()
def run_entry(tmp_path, capsys):
    """Run an entry point's ``main`` in this process; return its one error line (and check nothing was written)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**DEEPSPEED, "bertopt": {"train": {"max_steps": 1}}}))

    def run(task: str, argv: list[str], deepspeed_config: str | None = None) -> str:
        main = pretrain_main if task == "pretrain" else finetune_main
        cache = ["-o", f"data.cache_dir={tmp_path / 'cache'}"] if task == "pretrain" else []
        if "--output_dir" not in argv:
            argv = ["--output_dir", str(tmp_path / "out"), *argv]
        before = sorted(os.listdir(tmp_path))
        try:
            code = main(["--deepspeed_config", deepspeed_config or str(config), *cache, *argv])
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert sorted(os.listdir(tmp_path)) == before, "something was written"
        return lines[0]

    return run


@pytest.mark.parametrize("key, argv, task", CONFIG_CASES)
def test_every_config_field_refuses_bad_values_in_one_line(run_entry, key, argv, task):
    line = run_entry(task, argv)
    assert f"bertopt.{key.rsplit('.', 1)[0]}" in line and key.rsplit(".", 1)[1] in line, line


def test_the_generated_cases_cover_every_field_and_every_dead_rule():
    """Each field has a wrong-type case; every key some rule can make dead is reached by a single switch."""
    ids = [case.id for case in CONFIG_CASES]
    assert {i.split("-", 1)[1] for i in ids if i.startswith("type-")} == set(FIELDS)
    reachable = {key for switch in _switches() for key in _dead_under(switch)} | {"train.precision"}
    assert {i.split("-", 1)[1] for i in ids if i.startswith("dead-")} == reachable
    assert len(reachable) >= 40 and sum(i.startswith("range-") for i in ids) >= 60, ids


# --- path arguments ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny_bert")
    BertForMaskedLM(
        BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).save_pretrained(path)
    return path


PATH_ARGUMENTS = {
    # name: (task or subcommand, argv before the path, kind); kinds: file, dir, file_or_dir (a file or a datasets
    # directory), out_dir (need not exist; must be creatable)
    "train.output_dir": ("pretrain", ["--output_dir"], "out_dir"),
    "data.train_files": ("pretrain", ["--train_file"], "file"),
    "data.dataset": ("pretrain", ["-o", "data.dataset="], "dir"),
    "data.tokenizer": ("pretrain", ["--tokenizer"], "dir"),
    "data.cache_dir": ("pretrain", ["-o", "data.cache_dir="], "out_dir"),
    "model.init_checkpoint": ("pretrain", ["--model_name_or_path"], "dir"),
    "finetune.model_name_or_path": ("finetune", ["--model_name_or_path"], "dir"),
    "finetune.train_file": ("finetune", ["--train_file"], "file_or_dir"),
    "finetune.validation_file": ("finetune", ["--validation_file"], "file_or_dir"),
    "--deepspeed_config": ("pretrain", ["--deepspeed_config"], "file"),
    "--resume": ("pretrain", ["--resume"], "dir"),
    "ds-bertopt config FILE": ("config", [], "file"),
    "ds-bertopt hostfile FILE": ("hostfile", [], "file"),
    "ds-bertopt balance --lengths": ("balance", ["--lengths"], "file"),
    "ds-bertopt balance --corpus": ("balance", ["--corpus"], "file"),
    "ds-bertopt balance --tokenizer": ("balance", ["--corpus", "{prose}", "--tokenizer"], "dir"),
    "ds-bertopt memory --model": ("memory", ["--model"], "dir"),
}
"""Every path the user can give. A config field whose docstring speaks of a file or directory must be here."""
KINDS = {
    "file": ("missing", "dir_for_file", "unreadable"),
    "dir": ("missing", "file_for_dir", "unreadable"),
    "file_or_dir": ("missing", "not_a_dataset_dir", "unreadable"),
    "out_dir": ("file_for_dir", "not_creatable", "unreadable"),
}
PATH_CASES = [
    pytest.param(name, kind, id=f"path-{name.replace(' ', '_')}-{kind}")
    for name, (_, _, shape) in PATH_ARGUMENTS.items()
    for kind in KINDS[shape]
]


def test_every_path_field_is_generated():
    paths = {
        key
        for key, _, _, doc in iter_fields(BertOptConfig)
        if any(word in doc.lower() for word in ("directory", " file", "folder", "path"))
        and _inner(FIELDS[key][0]) in (str, tuple)
    }
    assert paths - set(PATH_ARGUMENTS) <= {
        "data.text_field",
        "finetune.tags_column",
        "finetune.train_split",
        "finetune.validation_split",
    }


def _bad_path(tmp_path: Path, kind: str) -> Path:
    (tmp_path / "a_file.txt").write_text("a few words of text\n")
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    (tmp_path / "a_dir" / "x.txt").write_text("x\n")
    if kind == "missing":
        return tmp_path / "no_such_thing"
    if kind == "file_for_dir":
        return tmp_path / "a_file.txt"
    if kind in ("dir_for_file", "not_a_dataset_dir"):
        return tmp_path / "a_dir"
    if kind == "not_creatable":
        return tmp_path / "a_file.txt" / "sub"
    locked = tmp_path / "locked"  # unreadable
    locked.mkdir()
    (locked / "inside.txt").write_text("x\n")
    locked.chmod(0)
    return locked / "inside.txt"


@pytest.mark.parametrize("name, kind", PATH_CASES)
def test_every_path_argument_refuses_bad_paths_in_one_line(tmp_path, capsys, run_entry, tiny_model, name, kind):
    where, before, _ = PATH_ARGUMENTS[name]
    bad = _bad_path(tmp_path, kind)
    prose = tmp_path / "prose.txt"
    prose.write_text("A short document. It has two sentences.\n\nAnother one here.\n" * 20)
    flag = [a.format(prose=prose) for a in before]
    argv = flag[:-1] + [f"{flag[-1]}{json.dumps(str(bad))}"] if flag and flag[-1].endswith("=") else flag + [str(bad)]
    try:
        with permissions_apply() if kind == "unreadable" else contextlib.nullcontext():
            line = _refusal_line(where, name, argv, bad, prose, run_entry, tiny_model, tmp_path, capsys)
    finally:
        if kind == "unreadable":
            bad.parent.chmod(0o755)
    assert str(bad) in line or name.split(" ")[-1].lstrip("-") in line, line


def _refusal_line(where, name, argv, bad, prose, run_entry, tiny_model, tmp_path, capsys) -> str:
    """The one error line the entry point ``where`` prints for the bad path ``bad``."""
    if where in ("pretrain", "finetune"):
        if where == "finetune" and name != "finetune.model_name_or_path":
            argv += ["--model_name_or_path", str(tiny_model)]
        if where == "finetune" and name != "finetune.train_file":
            argv += ["--train_file", str(prose.with_suffix(".csv"))]
            prose.with_suffix(".csv").write_text("text,label\n" + "a b c,0\nd e f,1\n" * 10)
        if name == "--deepspeed_config":
            line = run_entry(where, [], deepspeed_config=str(bad))
        else:
            line = run_entry(where, argv)
    else:
        existing = sorted(os.listdir(tmp_path))
        cache = ["--cache-dir", str(tmp_path / "cache")] if where == "balance" else []
        cache += ["--world-size", "2", "--ranks-per-node", "1"] if where == "balance" else []
        out = ["--output_dir", str(tmp_path / "out")] if where == "config" else []
        code = cli_main([where, *argv, *cache, *out])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if "error:" in x]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert sorted(os.listdir(tmp_path)) == existing
        line = lines[0]
    return line


# --- a handful through the real launcher -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_generated_cases_through_the_real_launcher(tmp_path):
    """Two of the generated kinds as a user types them (a process of its own, the launcher's CLI)."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**DEEPSPEED, "bertopt": {"train": {"max_steps": 1}}}))
    cases = [
        (["-o", "sampler.bins=[128]"], "bertopt.sampler.bins: has no effect: only the length-bin strategies"),
        (["--tokenizer", str(tmp_path / "nope")], f"data.tokenizer: {tmp_path / 'nope'} does not exist"),
    ]
    for extra, fragment in cases:
        proc = subprocess.run(
            [sys.executable, "launch/pretrain.py", "--deepspeed_config", str(config)]
            + ["--output_dir", str(tmp_path / "out"), "-o", f"data.cache_dir={tmp_path / 'cache'}", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=110,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["ds.json"]


def generated_count() -> dict[str, int]:
    """For the session summary: how many cases each kind generated."""
    kinds: dict[str, int] = {}
    for case in CONFIG_CASES + PATH_CASES:
        kind = case.id.split("-", 1)[0] if not case.id.startswith("path-") else "path"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def test_shipped_configs_set_no_dead_key():
    """Every shipped config passes the dead-key check as it is (a dead key there would refuse the README's command)."""
    from ds_bertopt.config import load_config

    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        cfg = load_config(str(path))
        dead = dead_keys(cfg)
        assert not [k for k in cfg.given if k in dead], (path.name, {k: dead[k] for k in cfg.given if k in dead})


def test_the_trainer_integration_refuses_dead_keys_too():
    from ds_bertopt.integrations.hf import load_bertopt

    with pytest.raises(
        ConfigError, match=r"bertopt\.bucket_clip\.max_norm: has no effect: bucket_clip\.enabled is false"
    ):
        load_bertopt({"bucket_clip": {"max_norm": 2.0}})
    assert load_bertopt({"bucket_clip": {"enabled": True, "max_norm": 2.0}}).bertopt.bucket_clip.max_norm == 2.0
