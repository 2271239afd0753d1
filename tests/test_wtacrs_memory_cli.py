"""``ds-bertopt memory``: the report on a small saved checkpoint (children measure the step peak)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_bert  # noqa: E402

from ds_bertopt.cli import main as cli_main  # noqa: E402
from ds_bertopt.cli.memory import _fit_largest_batch  # noqa: E402


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
    full, chosen = map(float, re.search(r"^\s+total\s+([\d.]+)\s+([\d.]+)$", out, re.M).groups())
    assert chosen < 0.5 * full, out  # every exact part, q/k/v and the FFN rebuilt in backward


def test_largest_batch_fit():
    # peaks 100 + 10·b: a budget of 355 fits b = 25, not 26; a flat or falling fit fits nothing
    assert _fit_largest_batch({8: 180, 16: 260}, 355.0)[:2] == (25, 10.0)
    assert _fit_largest_batch({8: 180, 16: 180}, 355.0)[0] == 0


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
