"""``ds-bertopt memory``: the report on a small saved checkpoint (children measure the step peak)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_bert  # noqa: E402


from ds_bertopt.cli import main as cli_main  # noqa: E402


@pytest.mark.timeout(240)
def test_memory_report_shows_the_saving(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_bert(hidden=64, layers=2, vocab=1000).save_pretrained(str(model_dir))
    argv = ["memory", "--model", str(model_dir), "--batch", "16", "--seq", "64", "--ratio", "0.3", "--kit", "exact"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    totals = re.search(r"^\s+total\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert totals, out
    full, chosen = map(float, totals.groups())
    assert chosen < 0.6 * full, out  # kit + WTA on a 2-layer model: attention, dropout, GELU, LN, ffn_out all cut
    saved_ratio = float(re.search(r"saved-for-backward ratio full/chosen: ([\d.]+)x", out).group(1))
    assert saved_ratio == pytest.approx(full / chosen, rel=0.02)
    assert re.search(r"whole-step peak ratio full/chosen: [\d.]+x", out), out
    assert re.search(r"against HF gradient checkpointing \(every layer, [\d.]+ MiB, [\d.]+x below full\)", out), out


@pytest.mark.timeout(240)
def test_memory_report_takes_a_preset(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_bert(hidden=64, layers=2, vocab=1000).save_pretrained(str(model_dir))
    assert cli_main(["memory", "--model", str(model_dir), "--batch", "8", "--seq", "32", "--preset", "exact"]) == 0
    out = capsys.readouterr().out
    assert "chosen: preset exact" in out, out
    # the fallback as a run decides it (same function), one line; the setup is still measured as asked
    assert re.search(
        r"^wtacrs: preset exact: activations are \d+% of the estimated peak .*so (keeping it|running full)", out, re.M
    ), out
    full, chosen = map(float, re.search(r"^\s+total\s+([\d.]+)\s+([\d.]+)$", out, re.M).groups())
    assert chosen < 0.5 * full, out  # every exact part, q/k/v and the FFN rebuilt in backward


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kit", "bogus"], "--kit: unknown part 'bogus'"),
        (["--ratio", "1.5"], "--ratio: must be in [0, 1], got 1.5"),
        (["--batch", "0"], "--batch: must be at least 1, got 0"),
    ],
)
def test_memory_bad_input_is_one_line(tmp_path, capsys, args, message):
    assert cli_main(["memory", "--model", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    tiny_bert(hidden=32, layers=1, vocab=300).save_pretrained(str(model_dir))  # max_position_embeddings 64
    return model_dir


@pytest.mark.parametrize(
    "case,args,message",
    [
        ("empty directory", [], "has no config.json (not a Hugging Face checkpoint)"),
        ("a file", [], "is not a directory"),
        ("too long", ["--seq", "65"], "--seq: 65 exceeds the model's max_position_embeddings 64"),
        ("no such targets", ["--targets", "nonexistent", "--batch", "2", "--seq", "8"], "--targets: 'nonexistent'"),
        ("compare without a budget", ["--compare"], "--compare: needs --budget-gb"),
        ("exhaustive without compare", ["--exhaustive"], "--exhaustive: only used with --compare"),
        ("tie margin without compare", ["--tie-margin", "0.2"], "--tie-margin: only used with --compare"),
        ("negative tie margin", ["--compare", "--budget-gb", "2", "--tie-margin", "-1"], "--tie-margin: must be in"),
    ],
)
@pytest.mark.timeout(120)
def test_memory_bad_models_and_settings_are_one_line(tmp_path, capsys, saved_tiny, case, args, message):
    """Issue 29: what used to end in a child's ``RuntimeError`` traceback is one line and exit status 2."""
    model = {"empty directory": tmp_path, "a file": tmp_path / "config.json"}.get(case, saved_tiny)
    if case == "a file":
        model.write_text("{}")
    assert cli_main(["memory", "--model", str(model), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err
    assert err[0].startswith("ds-bertopt memory: error: ")


def test_compare_sizes_every_setup_and_recommends_the_fastest_that_fits(monkeypatch, capsys, saved_tiny):
    from ds_bertopt.cli import memory as memory_cli
    from ds_bertopt.wtacrs.sizing import GiB, Measured

    rates = {"full": 10, "checkpointing": 12, "preset exact": 30, "preset balanced": 28}
    seen = []

    def measure(spec, setup, budget_bytes, batch=None, probe=16, max_batch=256, steps=2):
        seen.append((setup, probe, max_batch, steps, spec["seq"]))
        fits = setup != "full"
        return Measured(setup, 32, int((1 if fits else 3) * GiB), 32 / rates.get(setup, 20))

    monkeypatch.setattr(memory_cli, "measure", measure)
    argv = ["memory", "--model", str(saved_tiny), "--seq", "16", "--batch", "8", "--budget-gb", "2", "--compare"]
    assert cli_main(argv + ["--max-batch", "64", "--steps", "3", "--exhaustive"]) == 0
    out = capsys.readouterr().out
    assert [s[0] for s in seen] == list(memory_cli.COMPARED)
    assert all(s[1:] == (8, 64, 3, 16) for s in seen), seen
    assert "full: batch 32, peak 3.00 GiB (over 2.00)" in out, out
    assert re.search(r"^recommended: preset exact \(batch 32, .*\): the fastest that fits 2\.00 GiB", out, re.M), out


@pytest.mark.timeout(240)
def test_memory_report_measures_a_task_on_packed_rows(capsys, saved_tiny):
    """``--task`` and ``--unpadded``: the task's model with its targets, on packed rows (the unpadded task model and
    its loss), in the children; the kit still cuts what it saves."""
    argv = ["memory", "--model", str(saved_tiny), "--batch", "8", "--seq", "32", "--preset", "exact"]
    assert cli_main([*argv, "--task", "question_answering", "--unpadded"]) == 0
    out = capsys.readouterr().out
    assert "batch 8 × seq 32, question answering, packed rows" in out, out
    full, chosen = map(float, re.search(r"^\s+total\s+([\d.]+)\s+([\d.]+)$", out, re.M).groups())
    assert chosen < 0.6 * full, out


@pytest.mark.parametrize("task", ["classification", "regression", "token_classification", "question_answering"])
def test_every_task_is_measured_padded_and_packed_on_the_same_tokens(saved_tiny, task):
    """``train.finetune_memory.task_variant`` (what ``--task``/``--unpadded`` and ``preset: "auto"`` measure): the
    padded and the packed step hold the same real tokens, train, and save about as much for backward (every sequence
    is full length: packing removes no padding here, only the attention mask)."""
    import torch

    from ds_bertopt.train.finetune_memory import task_variant
    from ds_bertopt.wtacrs import saved_tensor_bytes

    saved = {}
    for packed in (False, True):
        model, make_batch = task_variant({"model": str(saved_tiny), "task": task, "packed": packed, "num_labels": 3})
        batch = make_batch(4, 16, 0)
        tokens = batch["input_ids"].numel()
        assert tokens == 64 and (batch["input_ids"].shape[0] == 1) == packed
        loss = model(**batch).loss
        assert torch.isfinite(loss) and loss.requires_grad
        saved[packed] = saved_tensor_bytes(model, batch)["total"]
        real = task_variant({"model": str(saved_tiny), "task": task, "packed": packed, "lengths": [5, 16, 9]})[1]
        shape = tuple(real(3, 16, 0)["input_ids"].shape)  # a real batch's lengths: padded to the longest, or packed
        assert shape == ((1, 30) if packed else (3, 16))
    assert saved[True] == pytest.approx(saved[False], rel=0.25), saved


def test_recomputation_saves_as_much_on_packed_rows(saved_tiny):
    """The wrapper that runs a prepared model on packed rows brackets its recompute scope (``wtacrs.run_from``):
    ``recompute_ffn``/``recompute_qkv`` cut as much saved-for-backward memory packed as padded."""
    from ds_bertopt.train.finetune_memory import task_variant
    from ds_bertopt.wtacrs import saved_tensor_bytes

    kit = {"sdpa_attention": True, "layernorm_saves_output": True, "recompute_gelu": True}
    cut = {}
    for packed in (False, True):
        saved = []
        for recompute in (False, True):
            parts = {**kit, "recompute_ffn": recompute, "recompute_qkv": recompute}
            model, make_batch = task_variant({"model": str(saved_tiny), "packed": packed, "wtacrs": {"kit": parts}})
            saved.append(saved_tensor_bytes(model, make_batch(4, 16, 0))["total"])
        cut[packed] = saved[0] - saved[1]
    assert cut[False] > 0 and cut[True] == pytest.approx(cut[False], rel=0.1), cut


def test_unpadded_families_only(tmp_path, capsys):
    import transformers

    config = transformers.DebertaV2Config(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32, max_position_embeddings=64)  # fmt: skip
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path / "deberta")
    assert cli_main(["memory", "--model", str(tmp_path / "deberta"), "--seq", "16", "--unpadded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--unpadded: deberta-v2 cannot run unpadded" in err[0], err


@pytest.mark.timeout(300)
def test_compare_fast_recommends_what_the_exhaustive_measurement_does(monkeypatch, capsys, saved_tiny):
    """Issue 40: ``--compare`` probes each setup in one child, times the simplest that fits first and then only those
    that could change the choice; on a tiny model with real children its recommendation (setup and batch) is the
    exhaustive one's, every setup is either timed or listed as pruned, and progress is printed per setup."""
    from ds_bertopt.cli import memory as memory_cli

    # full and checkpointing are a near-tie on a model this small (a step of fixed costs): which measures faster is
    # a coin flip, and only the tie margin (sizing.choose) makes both runs answer the same; max_saving is far
    # slower (it recomputes every layer and samples)
    names = ("full", "checkpointing", "preset max_saving")
    monkeypatch.setattr(memory_cli, "COMPARED", {k: memory_cli.COMPARED[k] for k in names})
    argv = ["memory", "--model", str(saved_tiny), "--seq", "64", "--batch", "8", "--budget-gb", "2", "--compare"]
    argv += ["--max-batch", "16", "--steps", "3"]
    recommended, outs = {}, {}
    for mode in ("fast", "exhaustive"):
        assert cli_main(argv + (["--exhaustive"] if mode != "fast" else [])) == 0
        out = outs[mode] = capsys.readouterr().out
        recommended[mode] = re.search(r"^recommended: (.+?) \(batch (\d+),", out, re.M)
        assert recommended[mode], out
        if mode == "fast":
            assert re.search(r"^  \[1/3\] full: peaks [\d.]+, [\d.]+ GiB at batch 1 and 2: fits batch 16", out, re.M)
            assert re.search(r"^  full: batch 16, peak .* sequences/s \(\d+ s\)$", out, re.M), out  # the reference
            listed = out.split("setups:\n", 1)[1]
            assert all(re.search(r"s/step|pruned: at most", line) for line in listed.splitlines()[:3]), out
    assert recommended["fast"].groups() == recommended["exhaustive"].groups(), outs
    assert recommended["fast"].group(2) == "16", recommended  # the budget is far above both: max_batch
