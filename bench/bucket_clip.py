"""Step time of bucket-wise clipping before allreduce vs DeepSpeed's global ``gradient_clipping``.

    python bench/bucket_clip.py [--quick]  # both settings, small BERT and BERT-base, ZeRO 0 and 2 (--quick: ~3 min)
    python bench/bucket_clip.py --sweep 1000000 2500000 5000000 10000000 25000000   # bucket sizes, emulated link
    python bench/bucket_clip.py --convergence   # launch/pretrain.py on wiki_sample: hook vs global clipping

Two gloo ranks (fp32, seq 128, random tokens, torch AdamW) build both engines from the same model, data and seed and
step them interleaved (median of ``--repeats`` after a warm-up), at ZeRO 2 with ``reduce_bucket_size`` = the clip
bucket size; over loopback and an emulated link (``ds_bertopt.testing.netns``: ``tc tbf rate 1gbit burst 256kb latency
50ms``; needs root and iproute2). "Exposed communication": the time in ``engine.allreduce_gradients`` (end of backward
to gradients ready) and, as ZeRO 1/2 reduce inside backward (synchronously on CPU), in ``reduce_ipg_grads``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import figure, argv, cpu_env, deepspeed_launcher, environment_line, interleaved, median, record
from bench._common import ROOT, SUMMARY, bert_sizes, pretrain_argv, ratio_line, read_metrics, say
from ds_bertopt.compat.deepspeed import wrap_reductions
from ds_bertopt.engine import initialize
from ds_bertopt.testing.distributed import free_port
from ds_bertopt.testing.netns import NetNamespaces, netns_unavailable_reason, remove_deepspeed_shm_buffers, remove_stale

MODELS = {  # name: (BertConfig fields, micro-batch, default bucket size in elements: docs/bucket_clip.md's sweep)
    "small": (bert_sizes(256, 4, 4, 1024, vocab_size=8192, max_position_embeddings=512), 8, 1_000_000),
    "base": ({}, 2, 5_000_000),  # transformers' BertConfig() defaults: BERT-base, 110M parameters
}
SEQ = 128
VARIANTS = ("bucket_clip", "deepspeed_clip")
BREAKDOWN: list[dict] = []
WIKI = ROOT.parent / "shared" / "data" / "wiki_sample.jsonl"  # --convergence's data


# worker: one rank (started by run_ranks, in this namespace or in its own)
def build_engine(sizes: dict, micro: int, stage: int, variant: str, bucket_size: int, precision: str = ""):
    """A ``BertForMaskedLM`` of ``sizes`` in our engine, clipped by ``variant`` (``bench/gpucheck``'s clip worker too);
    ``precision``: ``bertopt.train.precision`` where given."""
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**sizes, attn_implementation="sdpa"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": bucket_size}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1}
    cfg.update(gradient_clipping=1.0, steps_per_print=10**9, zero_optimization=zero)
    bertopt = {"train": {"precision": precision}} if precision else {}
    if variant == "bucket_clip":
        bertopt["bucket_clip"] = {"enabled": True, "max_norm": 1.0, "bucket_size": bucket_size}
    return initialize(config={**cfg, "bertopt": bertopt} if bertopt else cfg, model=model, optimizer=optimizer)[0]


def mlm_batch(vocab: int, micro: int, seq: int) -> dict:
    """This rank's random MLM batch: ids from ``5..vocab``, 15 % of the positions labelled."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    input_ids = torch.randint(5, vocab, (micro, seq), generator=gen)
    labels = torch.where(torch.rand(micro, seq, generator=gen) < 0.15, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def timed(timings: dict[str, list[float]], fn, key: str):
    """``fn`` adding its time to the step's entry, ``timings[key][-1]`` (``wrap_reductions``: on each call of
    ``engine.allreduce_gradients`` and ZeRO's ``reduce_ipg_grads``)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timings[key][-1] += time.perf_counter() - start
        return out

    return wrapper


def measure(name: str, stage: int, bucket_size: int, repeats: int, warmup: int) -> dict:
    sizes, micro = MODELS[name][:2]
    engines = {v: build_engine(sizes, micro, stage, v, bucket_size) for v in VARIANTS}
    timings: dict[str, dict[str, list[float]]] = {variant: {"exposed": [], "reduce": []} for variant in VARIANTS}
    for variant, engine in engines.items():
        wrap_reductions(engine, functools.partial(timed, timings[variant]))
    module = engines[VARIANTS[0]].module
    batch = mlm_batch(module.config.vocab_size, micro, SEQ)

    def step(variant: str) -> float:
        dist.barrier()  # start together, outside the timed region
        for series in timings[variant].values():
            series.append(0.0)
        start = time.perf_counter()
        engines[variant].backward(engines[variant](**batch).loss)
        engines[variant].step()
        return time.perf_counter() - start

    times = interleaved({v: functools.partial(step, v) for v in VARIANTS}, repeats=repeats, warmup=warmup)
    result = dict(model=name, stage=stage, bucket_size=bucket_size, micro_batch=micro, times=times)
    result["params"] = sum(p.numel() for p in module.parameters())
    result["buckets"] = len(engines["bucket_clip"].bucket_clip.layout())
    return {**result, **{key: {v: timings[v][key][warmup:] for v in VARIANTS} for key in ("exposed", "reduce")}}


def worker(args) -> int:
    import deepspeed  # here: imported, it picks an accelerator (and says so) in the orchestrator too

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for name, stage, bucket_size in itertools.product(args.models, args.stages, args.bucket_sizes):
        result = measure(name, stage, bucket_size, args.repeats, warmup=1)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_ranks(net, argv, log_dir: Path, tag: str, timeout: float) -> list[dict]:
    """Start rank 0 and 1 on loopback, or each in its network namespace of ``net``; return rank 0's RESULT lines."""
    master_addr, ifname = (net.addresses[0], net.ifname) if net else ("127.0.0.1", "lo")
    port, procs, results, deadline = str(free_port()), [], [], time.time() + timeout
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(log_dir / f"{tag}_rank{rank}.log", "w")) for rank in range(2)]
        for rank, log in enumerate(logs):
            ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2")
            env = cpu_env(MASTER_ADDR=master_addr, MASTER_PORT=port, GLOO_SOCKET_IFNAME=ifname, **ranks)
            out = subprocess.PIPE if rank == 0 else log
            options = dict(env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            procs.append(net.run(rank, argv, **options) if net else subprocess.Popen(argv, **options))
        try:
            for line in procs[0].stdout:
                logs[0].write(line)
                if line.startswith("RESULT "):
                    results.append(json.loads(line[len("RESULT ") :]))
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            for proc in (p for p in procs if p.poll() is None):
                proc.kill()
                proc.wait()
            remove_deepspeed_shm_buffers(master_addr, port)
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"{tag}: a rank failed (exit codes {[p.returncode for p in procs]}); logs in {log_dir}")
    return results


def report(setting: str, r: dict) -> None:
    """One measurement's ratio line and details; its bars in :data:`BREAKDOWN`."""
    model = f"{'small BERT' if r['model'] == 'small' else 'BERT-base'} {r['params'] / 1e6:.1f}M"
    buckets = f"{r['buckets']} buckets of <= {r['bucket_size'] / 1e6:g}M"
    label = f"[{setting}, {model}, mb {r['micro_batch']}, ZeRO {r['stage']}, {buckets}]"
    ours, theirs = r["times"]["bucket_clip"], r["times"]["deepspeed_clip"]
    say(ratio_line(f"bucket_clip step time {label}", ours, theirs, "deepspeed clip"))
    exposed, inside = ({v: median(r[key][v]) for v in VARIANTS} for key in ("exposed", "reduce"))
    for variant, times in (("bucket_clip", ours), ("deepspeed clip", theirs)):
        comm = exposed[variant.replace(" ", "_")]
        bars = {"compute and optimizer": median(times) - comm, "exposed communication": comm}
        BREAKDOWN.append({"label": f"{setting.split()[0]} {r['model']} Z{r['stage']} {variant}", **bars})
    zero = f"; inside reduce_ipg_grads {inside['bucket_clip']:.3f} s vs {inside['deepspeed_clip']:.3f} s"
    steps = f"speedup {median(theirs) / median(ours):.2f}x; step median {median(ours):.3f} s vs {median(theirs):.3f} s"
    comms = f"{exposed['bucket_clip']:.3f} s vs {exposed['deepspeed_clip']:.3f} s{zero if r['stage'] else ''}"
    print(f"    {steps}; exposed comm (end of backward -> grads ready) {comms}", flush=True)


def timings(args) -> None:
    """Every measurement of the settings (or of the bucket size sweep), each in a fresh pair of ranks."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_bucket_clip_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(environment_line())
    method = f"fp32, seq {SEQ}, 2 gloo ranks, torch AdamW, median of {args.repeats} steps after 1 warm-up"
    print(f"{method}; ratio < 1: bucket_clip is faster; logs in {log_dir}")
    plans = {"emulated": [(m, 0, size) for m in args.models for size in args.sweep]} if args.sweep else {}
    for setting in [] if args.sweep else args.settings:
        # --quick: the small model on loopback, BERT-base on the emulated link (the target case)
        models = [m for m in args.models if not args.quick or m == ("small" if setting == "loopback" else "base")]
        sizes = {m: args.bucket_sizes or [MODELS[m][2]] for m in models}
        plans[setting] = [(m, stage, size) for m in models for stage in args.stages for size in sizes[m]]
    for setting, combos in plans.items():
        started, emulated = time.time(), setting == "emulated"
        if emulated and netns_unavailable_reason(need_tc=True):
            print(f"emulated link: skipped ({netns_unavailable_reason(need_tc=True)})")
            continue
        if emulated:
            remove_stale()
        link = NetNamespaces(2, rate=args.rate, burst="256kb", latency="50ms") if emulated else contextlib.nullcontext()
        with link as net:
            title, results = f"emulated {args.rate} link" if emulated else "loopback", {}
            for model, stage, size in combos:  # a fresh pair of ranks each: DeepSpeed engines are not freed reliably
                script = (sys.executable, Path(__file__).resolve(), "--worker", "--bucket-sizes", size)
                worker_argv = argv(*script, models=model, stages=stage, repeats=args.repeats)
                for r in run_ranks(net, worker_argv, log_dir, f"{setting}_{model}_zero{stage}_{size}", timeout=1800):
                    report(title, r)
                    results.setdefault(r["model"], []).append(r)
        for model, runs in results.items() if args.sweep else ():
            ours = [(r["bucket_size"], *(median(r[key]["bucket_clip"]) for key in ("times", "exposed"))) for r in runs]
            points = ", ".join(f"{size / 1e6:g}M: {step:.3f} s (exposed {comm:.3f} s)" for size, step, comm in ours)
            print(f"bucket size sweep, {model}, bucket_clip step median: {points}", flush=True)
        print(f"    ({setting}{' sweep' if args.sweep else ''}: {time.time() - started:.0f} s)", flush=True)
    if BREAKDOWN:
        title = "Step time: bucket_clip vs DeepSpeed clipping (exposed communication on top)"
        stack = ["compute and optimizer", "exposed communication"]
        figure("bars", "breakdown", title, BREAKDOWN, stack=stack, unit="seconds per step (median)")
        record("bucket_clip", f"2 gloo ranks, fp32, seq {SEQ}, median of {args.repeats} steps after 1 warm-up")


# convergence: launch/pretrain.py with the hook vs DeepSpeed's global clipping
def pretrain(run_dir: Path, seed: int, hook: bool, args) -> bool:
    """Run one pretraining unless ``run_dir`` holds a complete one; return whether it ran."""
    evals = read_metrics(run_dir, "eval_loss")
    if evals and evals[-1]["step"] == args.steps:
        return False  # complete already (use a fresh --convergence-dir to redo)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    clip = ["bucket_clip.enabled=true", f"bucket_clip.bucket_size={args.conv_bucket_size}"] if hook else []
    overrides = [f"train.eval_every={args.eval_every}", "train.log_every=10", "train.save_model=false", *clip]
    script = pretrain_argv(run_dir, args.ds_config, overrides, train_file=WIKI, max_steps=args.steps, seed=seed)
    try:
        with open(f"{run_dir}.log", "w") as log:
            cmd = [*deepspeed_launcher(2, port), *script]
            subprocess.run(cmd, cwd=ROOT, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, check=True)
    finally:
        remove_deepspeed_shm_buffers("127.0.0.1", port)  # the launcher's default master address
    return True


def convergence(args) -> None:
    print(environment_line())
    if not WIKI.exists():
        print(f"convergence: skipped ({WIKI} is absent)")
        return
    curves = {}  # (hook, seed): {"loss": training records, "eval_loss": eval records}
    for seed, hook in itertools.product(args.seeds, (True, False)):
        run_dir = Path(args.convergence_dir) / f"{'hook' if hook else 'global'}_s{seed}"
        started = time.time()
        ran = pretrain(run_dir, seed, hook, args)
        curves[hook, seed] = {key: read_metrics(run_dir, key) for key in ("loss", "eval_loss")}
        print(f"    ({run_dir.name}: {f'{time.time() - started:.0f} s' if ran else 'complete run reused'})", flush=True)
    final = {key: runs["eval_loss"][-1]["eval_loss"] for key, runs in curves.items()}
    hook_final, global_final = ([final[hook, s] for s in args.seeds] for hook in (True, False))
    seeds = ", ".join(map(str, args.seeds))
    texts = [" / ".join(f"{x:.4f}" for x in losses) for losses in (hook_final, global_final)]
    finals = f"final eval loss bucket_clip {texts[0]} vs global clip {texts[1]}"
    print(f"convergence [wiki_sample.jsonl, {args.ds_config}, {args.steps} steps, seeds {seeds}]: {finals}", flush=True)
    spread = [abs(final[h, a] - final[h, b]) for h in (True, False) for a, b in zip(args.seeds, args.seeds[1:])]
    diff = statistics.fmean(hook_final) - statistics.fmean(global_final)
    spreads = f"    mean difference (bucket_clip - global) {diff:+.4f}; seed-to-seed spread within a variant "
    print(f"{spreads}{max(spread):.4f}" if spread else "", flush=True)
    # eval and training loss (mean of 10 steps) of every run, drawn from the record by bench/_report.py
    for kind, title, key in (("eval", "Held-out", "eval_loss"), ("training", "Training", "loss")):
        series = []
        for (hook, seed), runs in sorted(curves.items()):
            label, steps = f"{'bucket_clip' if hook else 'global clip'} seed {seed}", [r["step"] for r in runs[key]]
            series.append({"label": label, "x": steps, "y": [r[key] for r in runs[key]]})
        title = f"{title} MLM loss: bucket_clip vs global clipping"
        figure("curves", f"{kind}_loss", title, series, xlabel="step", ylabel=f"{kind} MLM loss")
    SUMMARY.append(f"{finals} ({args.steps} steps, seeds {seeds})")
    note = f"launch/pretrain.py, {args.ds_config}, wiki_sample.jsonl, 2 ranks, {args.steps} steps, seeds {seeds}"
    record("bucket_clip_convergence", note)


def main(args_in=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="ZeRO 0, 3 rounds; small BERT on loopback, base on the link")
    p.add_argument("--settings", nargs="+", default=["loopback", "emulated"], choices=["loopback", "emulated"])
    p.add_argument("--models", nargs="+", default=["small", "base"], choices=sorted(MODELS))
    p.add_argument("--stages", nargs="+", type=int, default=None, help="ZeRO stages (default 0 2; --quick: 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; --quick: 3)")
    p.add_argument("--bucket-sizes", nargs="+", type=int, help="clip bucket sizes (default: 1M small, 5M base)")
    p.add_argument("--sweep", nargs="+", type=int, help="bucket sizes to sweep at ZeRO 0 on the emulated link")
    p.add_argument("--rate", default="1gbit", help="emulated link rate (tc tbf)")
    p.add_argument("--log-dir", default=None, help="where the ranks' logs go (default: a temp dir)")
    p.add_argument("--convergence", action="store_true", help="instead: launch/pretrain.py, hook vs global clipping")
    p.add_argument("--convergence-dir", default=str(ROOT / "runs" / "bucket_clip_convergence"))
    p.add_argument("--ds-config", default="ds_configs/bert.json", help="config for --convergence")
    p.add_argument("--steps", type=int, default=400, help="pretraining steps for --convergence")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 7])
    p.add_argument("--conv-bucket-size", type=int, default=250_000, help="--convergence's (bert.json: 1.5M parameters)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(args_in)
    args.stages = args.stages or ([0] if args.quick else [0, 2])
    args.repeats = args.repeats or (3 if args.quick else 7)
    if args.worker:
        return worker(args)
    (convergence if args.convergence else timings)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
