"""DeepSpeed's part of a config is checked by DeepSpeed's own parser, with one line per problem."""

from __future__ import annotations

import json

import pytest

from ds_bertopt.dsconfig import check_deepspeed_config
from ds_bertopt.errors import ConfigError


@pytest.fixture(scope="module")
def base():
    ds = json.load(open("ds_configs/bert.json"))
    ds.pop("bertopt")
    return ds


@pytest.mark.parametrize(
    "config", ["bert.json", "bert_zero2.json", "bert_zero3.json", "bert_large_lamb.json", "finetune_zero3.json"]
)
def test_shipped_configs_pass(config):
    ds = json.load(open(f"ds_configs/{config}"))
    ds.pop("bertopt")
    check_deepspeed_config(ds)


CASES = [
    (
        {"gradient_accumulation_step": 4},
        "deepspeed: unknown key 'gradient_accumulation_step' (did you mean 'gradient_accumulation_steps'?)",
    ),
    ({"zero_optimization": {"stag": 2}}, "deepspeed.zero_optimization: unknown key 'stag' (did you mean 'stage'?)"),
    ({"zero_optimization": {"stage": "two"}}, "deepspeed.zero_optimization.stage: Input should be 0, 1, 2, 3"),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"devic": "cpu"}}},
        "deepspeed.zero_optimization.offload_optimizer: unknown key 'devic' (did you mean 'device'?)",
    ),
    ({"bf16": {"enabeld": True}}, "deepspeed.bf16: unknown key 'enabeld' (did you mean 'enabled'?)"),
    ({"gradient_clipping": "1.0"}, 'deepspeed.gradient_clipping: expected a number, got "1.0"'),
    ({"wall_clock_breakdown": 1}, "deepspeed.wall_clock_breakdown: expected true or false, got 1"),
    (
        {"csv_monitor": {"enabled": True, "job": "x"}},
        "deepspeed.csv_monitor: unknown key 'job' (did you mean 'job_name'?)",
    ),
    ({"flops_profiler": {"enable": True}}, "deepspeed.flops_profiler: unknown key 'enable' (did you mean 'enabled'?)"),
    (
        {"activation_checkpointing": {"partition_activation": True}},
        "deepspeed.activation_checkpointing: unknown key 'partition_activation' "
        "(did you mean 'partition_activations'?)",
    ),
]


@pytest.mark.parametrize("extra, line", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)])
def test_mistakes_get_one_line_naming_the_key(base, extra, line):
    with pytest.raises(ConfigError) as info:
        check_deepspeed_config({**base, **extra})
    message = str(info.value)
    assert message.startswith(line), message
    assert "\n" not in message


def test_blocks_handed_on_whole_are_left_to_their_consumer(base):
    """The optimizer's keyword arguments are checked by the optimizer, not by DeepSpeed's parser."""
    check_deepspeed_config({**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}})
    with pytest.raises(ConfigError, match="deepspeed.optimizer: unknown key 'parms' .did you mean 'params'"):
        check_deepspeed_config({**base, "optimizer": {"type": "Adam", "parms": {}}})
