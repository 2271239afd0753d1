"""The data's life cycle (docs/data.md): long work handed off without a collective timeout (ds_bertopt.handoff), the
stored fingerprint and the cheap restart, the build spread over processes and over the nodes that share a cache,
``ds-bertopt prepare-data``, and a pretraining start that imports only its own task."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ds_bertopt import handoff
from ds_bertopt.config import BertOptConfig, DataConfig
from ds_bertopt.data import identity, manifest
from ds_bertopt.data.crew import groups_from_views
from ds_bertopt.data.pipeline import build_pretrain_data, settings_key
from ds_bertopt.data.tokenizer import count_words_parallel, wordpiece_vocab
from ds_bertopt.errors import JobError


def _cfg(corpus, cache_dir, **data):
    return BertOptConfig(
        data=DataConfig(train_files=(str(corpus),), cache_dir=str(cache_dir), tokenizer_vocab_size=2000, **data)
    )


# ---------------------------------------------------------------- handing work off through the store
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_wait_reports_progress_every_30_s_and_gives_up_on_a_silent_worker():
    import torch.distributed as dist

    store, clock, lines = dist.HashStore(), FakeClock(), []
    labels = {"data/node1": "node 1's data build"}
    beats = iter(range(1, 10**6))

    def sleep(seconds):  # the worker publishes a new beat (alive) until 200 s, a shard every 10 s
        clock.sleep(seconds)
        if clock.now < 200:
            done = min(16, int(clock.now // 10))
            snapshot = {"stage": "tokenizing train documents", "done": done, "total": 16, "unit": "shards"}
            snapshot.update(elapsed=clock.now, stage_elapsed=clock.now, beat=next(beats), host="h1", pid=7)
            store.set("ds_bertopt/work/data/node1/progress", json.dumps(snapshot))

    said_at = []
    say = lambda line: (lines.append(line), said_at.append(clock.now))  # noqa: E731
    with pytest.raises(JobError) as info:
        handoff.wait_for(store, ["data/node1"], labels, stale_s=120, say=say, clock=clock, sleep=sleep)
    assert said_at[0] <= handoff.FIRST_REPORT_S + 1 and max(np.diff(said_at)) <= handoff.REPORT_EVERY_S + 1
    assert len(lines) >= 10 and handoff.REPORT_EVERY_S == 30
    line = next(x for x in lines if "6 of 16" in x)
    assert line.startswith("waiting for node 1's data build: tokenizing train documents, 6 of 16 shards, 1m0"), line
    assert line.endswith("left of this stage"), line
    assert str(info.value).startswith("node 1's data build on h1 (pid 7) stopped reporting for 12"), info.value
    assert "train.dist_timeout_s 120" in str(info.value) and "its process died or hung" in str(info.value)


def test_the_workers_own_error_reaches_the_waiting_ranks(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(handoff, "LINGER_S", 0.0)  # no waiting rank polls here
    store = dist.HashStore()
    with pytest.raises(OSError):
        with handoff.Work(store, "data/node0", "node 0's data build"):
            raise OSError(28, "No space left on device", "/cache/sequences/part.arrow")
    with pytest.raises(JobError, match=r"^no space left on the device of /cache/sequences/part.arrow"):
        handoff.wait_for(store, ["data/node0"], {"data/node0": "x"}, stale_s=10)
    with handoff.Work(store, "w", "w") as work:
        work.finish({"answer": 42})
    assert handoff.wait_for(store, ["w"], {"w": "w"}, stale_s=10) == {"w": {"answer": 42}}


def test_nodes_share_a_cache_only_with_the_nodes_that_see_the_same_files():
    views = {0: frozenset({0, 1}), 1: frozenset({0, 1}), 2: frozenset({2}), 3: frozenset({3, 2})}
    assert groups_from_views(views) == {0: (0, 1), 1: (0, 1), 2: (2,), 3: (3,)}  # 2 saw 3's file late: both alone


# ---------------------------------------------------------------- the stored fingerprint and the restart
def test_a_restart_opens_the_stored_build_and_finds_a_changed_corpus_without_a_full_rehash(
    tmp_path, small_corpus, monkeypatch, capsys
):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(small_corpus.read_bytes())
    first = build_pretrain_data(_cfg(corpus, tmp_path / "cache", max_seq_length=64))
    assert first.opened.startswith("built in") and "manifest.json" in first.opened

    hashed: list[int] = []  # rows hashed per digest: the full digest of every row is the build's, never a restart's
    real = identity.table_digest
    monkeypatch.setattr(manifest, "table_digest", lambda t, c: hashed.append(t.num_rows) or real(t, c))
    monkeypatch.setattr(identity, "table_digest", lambda t, c: hashed.append(t.num_rows) or real(t, c))
    again = build_pretrain_data(_cfg(corpus, tmp_path / "cache", max_seq_length=64))
    assert again.opened.startswith("opened the stored build") and "re-hashed 4096 sampled sequences" in again.opened
    assert again.fingerprint.identity() == first.fingerprint.identity()
    assert isinstance(again.lengths, np.ndarray) and not again.lengths.flags.writeable  # the mapped file, no copy
    np.testing.assert_array_equal(again.lengths, [len(x) for x in again.train["input_ids"]])
    assert hashed == [] or max(hashed) <= manifest.SAMPLED_SEQUENCES

    with open(corpus, "a", encoding="utf-8") as fh:  # a user edits the corpus
        fh.write(json.dumps({"text": "A new document. It has two sentences about kernels and queues."}) + "\n")
    hashed.clear()
    capsys.readouterr()
    changed = build_pretrain_data(_cfg(corpus, tmp_path / "cache", max_seq_length=64))
    said = capsys.readouterr().out
    assert f"corpus file {corpus} changed since the cache was built (size " in said, said
    assert changed.opened.startswith("built in") and changed.fingerprint.samples != first.fingerprint.samples


def test_a_cache_file_changed_in_place_is_found_by_the_sampled_rehash(tmp_path, small_corpus, capsys):
    cfg = _cfg(small_corpus, tmp_path / "cache", max_seq_length=64)
    built = build_pretrain_data(cfg)
    stored = manifest.read(str(tmp_path / "cache"), settings_key(cfg)[0])
    path = tmp_path / "cache" / stored["train"]["files"][0]["path"]
    row = np.asarray(built.train[3]["input_ids"][1:4], dtype=np.int32).tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(row)
    assert at > 0
    data[at : at + 4] = np.asarray([built.train[3]["input_ids"][1] + 1], dtype=np.int32).tobytes()
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same modification time
    capsys.readouterr()
    rebuilt = build_pretrain_data(cfg)
    said = capsys.readouterr().out
    assert "no longer match their stored fingerprint (4096 sampled sequences re-hashed differ)" in said, said
    assert rebuilt.fingerprint.samples == built.fingerprint.samples  # rebuilt: the same data again


# ---------------------------------------------------------------- the build spread over processes and nodes
def test_word_counts_over_any_process_count_give_one_vocabulary(tmp_path):
    from test_preprocess import synthetic_documents

    from ds_bertopt.data.corpus import load_documents

    cfg = DataConfig(train_files=(str(synthetic_documents(tmp_path, count=300)),), cache_dir=str(tmp_path / "c"))
    documents = load_documents(cfg, cfg.cache_dir)
    one, two = count_words_parallel(documents, 1), count_words_parallel(documents, 2)
    assert one == two and sum(one.values()) > 10_000
    assert wordpiece_vocab(one, 1000) == wordpiece_vocab(two, 1000)


def _build_on_a_node(rank, world_size, corpus, cache):  # noqa: ARG001 - spawn_ranks' signature
    import torch.distributed

    from ds_bertopt.dist import topology_from_env

    topo = topology_from_env()
    cfg = _cfg(corpus, cache, num_proc=1)
    data = build_pretrain_data(cfg, topo)
    torch.distributed.barrier()  # as a job goes on to train: rank 0, which serves the store, waits for the others
    return data.fingerprint.identity(), manifest.read(cache, settings_key(cfg)[0])["nodes"], len(data.train)


@pytest.mark.timeout(300)
def test_two_nodes_on_one_shared_cache_build_disjoint_shards_identical_to_one_node(tmp_path):
    from test_preprocess import synthetic_documents

    from ds_bertopt.testing.distributed import spawn_ranks

    corpus = synthetic_documents(tmp_path, count=1100)  # 1,045 training documents: 5 map batches, so 5 parts
    results = spawn_ranks(_build_on_a_node, 2, str(corpus), str(tmp_path / "shared"), ranks_per_node=1)
    (identity0, nodes0, rows), (identity1, nodes1, _) = results
    assert identity0 == identity1 and nodes0 == nodes1 == [0, 1]  # one crew: both nodes built the stored build
    alone = build_pretrain_data(_cfg(corpus, tmp_path / "alone", num_proc=1))
    assert alone.fingerprint.identity() == identity0 and len(alone.train) == rows


def _auto_on_a_rank(rank, world_size):  # noqa: ARG001
    import torch

    from ds_bertopt.errors import BertOptError
    from ds_bertopt.wtacrs import sizing
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    def measure(spec, setup, budget_bytes, batch=None, probe=16, max_batch=256, steps=2):  # noqa: ARG001
        assert rank == 0, "only rank 0 measures"
        peak = {"no preset": 6.0, "checkpointing": 3.0}.get(setup, 2.0)
        return sizing.Measured(setup, batch, int(peak * sizing.GiB), 1.0 if setup == "no preset" else 1.2)

    sizing.measure = measure
    outcomes = []
    for budget in (4.0, 1.0):  # a choice, then a budget nothing fits (rank 0's ConfigError)
        try:
            cfg = WtaCrsConfig(preset="auto", memory_budget=budget)
            chosen, batch, _ = sizing.resolve_auto(cfg, model_dir="x", batch=8, seq=16)
            outcomes.append((chosen.preset, batch))
        except BertOptError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    import torch.distributed

    torch.distributed.barrier()  # as a job goes on to its collectives: rank 0, hosting the store, stays
    return outcomes


@pytest.mark.timeout(200)
def test_preset_auto_measured_on_rank_0_reaches_every_rank_through_the_store():
    from ds_bertopt.testing.distributed import spawn_ranks

    (chosen0, (kind0, line0)), (chosen1, (kind1, line1)) = spawn_ranks(_auto_on_a_rank, 2)
    assert chosen0 == chosen1 and chosen0[1] == 8
    assert (kind0, kind1) == ("ConfigError", "JobError") and line0 == line1 and "no setup fits" in line0


# ---------------------------------------------------------------- prepare-data, and the pretraining start's imports
def test_prepare_data_builds_the_cache_that_a_job_then_opens(tmp_path, small_corpus, repo_root, capsys):
    from ds_bertopt.cli import main
    from ds_bertopt.config import load_config

    cache = tmp_path / "cache"
    overrides = [f"data.cache_dir={cache}", "data.tokenizer_vocab_size=2000"]
    args = ["--deepspeed_config", str(repo_root / "ds_configs" / "bert.json"), "--train_file", str(small_corpus)]
    assert main(["prepare-data", *args, *sum((["-o", o] for o in overrides), [])]) == 0
    said = capsys.readouterr().out
    assert "prepare-data: " in said and "training sequences" in said and f"data.cache_dir {cache} opens it" in said
    cfg = load_config(str(repo_root / "ds_configs" / "bert.json"), [*overrides, f'data.train_files=["{small_corpus}"]'])
    job = build_pretrain_data(cfg.bertopt)
    assert job.opened.startswith("opened the stored build"), job.opened


def test_prepare_data_refuses_resume_in_one_line_before_building(tmp_path, repo_root, capsys):
    from ds_bertopt.cli import main

    cache = tmp_path / "cache"
    args = ["--deepspeed_config", str(repo_root / "ds_configs" / "bert.json"), "-o", f"data.cache_dir={cache}"]
    assert main(["prepare-data", *args, "--resume"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--resume has no effect on prepare-data" in errors[0], errors
    assert not cache.exists()


def test_the_pretraining_entry_point_does_not_import_the_fine_tuning_task(repo_root):
    code = (
        "import runpy, sys; runpy.run_path('launch/pretrain.py', run_name='imported');"
        "assert 'ds_bertopt.train.tasks.pretrain' in sys.modules;"
        "print('ds_bertopt.train.tasks.finetune' in sys.modules, 'ds_bertopt.wtacrs.sizing' in sys.modules);"
        "from ds_bertopt.train.tasks import FinetuneTask, TASKS;"
        "print('ds_bertopt.train.tasks.finetune' in sys.modules, sorted(TASKS))"
    )
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["False False", "True ['finetune', 'pretrain']"], out.stdout
