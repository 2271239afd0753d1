"""Config loading: strict ``"bertopt"`` section, overrides, batch arithmetic, precision."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_bertopt.config import CPU_BF16_ENV, BertOptConfig, apply_precision, load_config, resolve_batch
from ds_bertopt.configlib import load_section, parse_override
from ds_bertopt.errors import ConfigError


def write(tmp_path, obj, name="cfg.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_shipped_configs_load(repo_root):
    configs = sorted((repo_root / "ds_configs").glob("*.json"))
    assert configs, "ds_configs/ is empty"
    for path in configs:
        cfg = load_config(str(path))
        assert isinstance(cfg.bertopt, BertOptConfig)
        assert "bertopt" not in cfg.deepspeed


def test_defaults_and_nested_values(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            {
                "train_micro_batch_size_per_gpu": 4,
                "bertopt": {"train": {"max_steps": 7}, "data": {"train_files": ["a.txt"]}},
            },
        )
    )
    assert cfg.bertopt.train.max_steps == 7
    assert cfg.bertopt.data.train_files == ("a.txt",)
    assert cfg.bertopt.model.hidden_size == BertOptConfig().model.hidden_size


@pytest.mark.parametrize(
    "section, message",
    [
        ({"train": {"max_step": 3}}, "bertopt.train: unknown key 'max_step' (did you mean 'max_steps'?)"),
        ({"trian": {}}, "bertopt: unknown key 'trian' (did you mean 'train'?)"),
        ({"train": {"max_steps": "3"}}, "bertopt.train.max_steps: expected an integer"),
        ({"train": {"max_steps": 0}}, "bertopt.train.max_steps: must be positive"),
        ({"train": {"save_model": 1}}, "bertopt.train.save_model: expected true or false"),
        ({"model": {"objective": "nsp"}}, 'bertopt.model.objective: "nsp" is not one of'),
        ({"model": {"num_attention_heads": 3}}, "bertopt.model.num_attention_heads: 3 does not divide"),
        ({"data": {"max_seq_length": 1024}}, "exceeds the model's max_position_embeddings 512"),
        ({"data": {"mlm_probability": 1.5}}, "bertopt.data.mlm_probability: must be in (0, 1)"),
        ({"data": {"train_files": "a.txt"}}, "bertopt.data.train_files: expected a list"),
        ({"train": []}, "bertopt.train: expected an object"),
        ({"optimizer": {"lr": float("inf")}}, "bertopt.optimizer.lr: expected a finite number"),
    ],
)
def test_bad_bertopt_section_names_the_key(tmp_path, section, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "bertopt": section}))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="is not valid JSON: .* line 1"):
        load_config(write(tmp_path, "{not json"))
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match="JSON object at the top level"):
        load_config(write(tmp_path, "[1, 2]"))
    (tmp_path / "latin1.json").write_bytes('{"a": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(str(tmp_path / "latin1.json"))


def test_overrides_apply_to_both_parts(tmp_path):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 4, "bertopt": {"train": {"max_steps": 7}}})
    cfg = load_config(
        path,
        [
            "train.max_steps=9",
            'bertopt.data.train_files=["x.txt"]',
            "deepspeed.zero_optimization.stage=2",
            "train.output_dir=some/dir",
        ],
    )
    assert cfg.bertopt.train.max_steps == 9
    assert cfg.bertopt.data.train_files == ("x.txt",)
    assert cfg.deepspeed["zero_optimization"]["stage"] == 2
    assert cfg.bertopt.train.output_dir == "some/dir"
    with pytest.raises(ConfigError, match="unknown key 'max_stepz'"):
        load_config(path, ["train.max_stepz=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("train.max_steps")


@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"train_micro_batch_size_per_gpu": 8}, 2, (16, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, 2, (64, 8, 4)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 2, (64, 8, 4)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, (64, 8, 2)),
        (
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
            4,
            (64, 8, 2),
        ),
    ],
)
def test_resolve_batch(given, world, expected):
    ds = resolve_batch(given, world)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == expected


@pytest.mark.parametrize(
    "given, world, message",
    [
        ({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8}, 2, "not divisible by"),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 2, "!="),
        ({"train_micro_batch_size_per_gpu": 0}, 2, "must be a positive integer"),
        ({"gradient_accumulation_steps": 2}, 2, "give it"),
    ],
)
def test_resolve_batch_rejects_inconsistent(given, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch(given, world)


def test_precision_rules():
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU.*bf16"):
        apply_precision({"fp16": {"enabled": True}}, "auto", "cpu")
    with pytest.raises(ConfigError, match="both enabled"):
        apply_precision({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "auto", "cuda")
    ds = {}
    assert apply_precision(ds, "bf16", "cpu")[0] == "bf16" and ds == {"bf16": {"enabled": True}}
    user = {"bf16": {"enabled": False}}
    assert apply_precision(user, "bf16", "cpu") == ("fp32", "set by the DeepSpeed fp16/bf16 block")  # the user's wins
    with pytest.raises(ConfigError, match="fp16 is not supported on CPU"):
        apply_precision({}, "fp16", "cpu")
    with pytest.raises(ConfigError, match="deepspeed.bf16: expected an object"):
        apply_precision({"bf16": True}, "auto", "cpu")


@pytest.mark.parametrize("flag, picked", [("1", "bf16"), ("0", "fp32")])
def test_auto_precision_follows_the_cpu_and_says_why(monkeypatch, flag, picked):
    """``auto`` picks bf16 only where the CPU has it natively; the override stands in for the other CPU kind."""
    monkeypatch.setenv(CPU_BF16_ENV, flag)
    ds = {}
    precision, why = apply_precision(ds, "auto", "cpu")
    assert precision == picked and f"{CPU_BF16_ENV}={flag}" in why
    assert ("bf16" in ds) == (picked == "bf16")
    assert apply_precision({}, "fp32", "cpu") == ("fp32", "set by train.precision")  # pinned: the CPU does not matter
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ConfigError, match=f"{CPU_BF16_ENV}='yes': use 1 or 0"):
        apply_precision({}, "auto", "cpu")


def test_every_field_has_a_docstring():
    """House rule: a docstring per config field (read from the source, as users do)."""
    import ast
    import inspect

    import ds_bertopt.config as config_module
    from ds_bertopt.configlib import to_dict

    sections = {type(v) for v in vars(BertOptConfig()).values()} | {BertOptConfig}
    for cls in sections:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
        documented = {
            body[i].target.id
            for i in range(len(body) - 1)
            if isinstance(body[i], ast.AnnAssign)
            and isinstance(body[i + 1], ast.Expr)
            and isinstance(body[i + 1].value, ast.Constant)
            and isinstance(body[i + 1].value.value, str)
        }
        missing = [f for f in fields if f not in documented]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
    assert to_dict(BertOptConfig())["train"]["max_steps"] == BertOptConfig().train.max_steps
    assert config_module.describe


def test_load_section_roundtrip():
    cfg = BertOptConfig()
    from ds_bertopt.configlib import to_dict

    assert load_section(BertOptConfig, to_dict(cfg), "bertopt") == cfg


def _field_names():
    import dataclasses

    names = set()
    for section in dataclasses.fields(BertOptConfig):
        names.add(section.name)
        names.update(f.name for f in dataclasses.fields(section.default_factory()))
    return sorted(names)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=True), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
keys = st.one_of(st.sampled_from(_field_names()), st.text(max_size=6))
sections = st.dictionaries(keys, st.one_of(json_values, st.dictionaries(keys, json_values, max_size=6)), max_size=6)


@settings(max_examples=400, deadline=None)
@given(section=sections)
def test_random_sections_only_raise_config_error(section):
    """Property: whatever JSON the user writes, the loader succeeds or raises ConfigError."""
    try:
        cfg = load_section(BertOptConfig, section, "bertopt")
    except ConfigError as exc:
        assert str(exc).startswith("bertopt") and "\n" not in str(exc)
    else:
        assert isinstance(cfg, BertOptConfig)


def test_the_keys_a_config_sets_are_recorded(tmp_path):
    """What the pre-flight checks against the task's ``reads``: file keys and overrides, leaves only."""
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "bertopt": {"model": {"hidden_size": 64}, "wtacrs": {}}})
    )
    cfg = load_config(
        str(path), ["bertopt.train.max_steps=3", "wtacrs.kit.sdpa_attention=true", "deepspeed.steps_per_print=9"]
    )
    assert cfg.given == {"model.hidden_size", "train.max_steps", "wtacrs.kit.sdpa_attention"}
