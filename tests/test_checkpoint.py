"""Checkpoint files we write and read ourselves: RNG states round-trip, and loading them runs no code."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from ds_bertopt.train.checkpoint import load_rng_state, rng_state, set_rng_state


def _draws():
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), float(torch.rand(1))


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.randn()  # leave a cached Gaussian in both generators
    path = tmp_path / "rng_rank0.pt"
    torch.save(rng_state(), path)
    expected = _draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_rng_state(str(path)))
    assert _draws() == expected


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_a_crafted_rng_file_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "rng_rank0.pt"
    with open(path, "wb") as fh:
        pickle.dump({"python": _Payload()}, fh)
    with pytest.raises(pickle.UnpicklingError):
        load_rng_state(str(path))
    assert not (tmp_path / "PWNED").exists()
