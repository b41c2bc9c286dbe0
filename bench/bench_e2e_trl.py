#!/usr/bin/env python
"""End to end against a peer: this project's DAPO trainer versus Hugging Face TRL's GRPOTrainer configured as
DAPO, same task, base model, batch, response length, learning rate and optimizer steps per rollout batch, on
the same CPU, one after the other.

    python bench/bench_e2e_trl.py [--sizes demo large] [--seeds 0 1 2] [--steps N] [--quick] [--json PATH]
        [--trl-python PY]
    python bench/bench_e2e_trl.py --sizes large --pairs 3 [--same-work-steps N]    # throughput only
    python bench/bench_e2e_trl.py --sizes large --seeds 0 1 2 --keep DIR --resume  # goes on where it stopped

TRL lives in its own virtual environment, never in .venv (see requirements-bench.txt):
    python3.11 -m venv /tmp/benchvenv && /tmp/benchvenv/bin/pip install torch==2.13.0 \
        && /tmp/benchvenv/bin/pip install -r requirements-bench.txt
and runs as a subprocess (bench/trl_dapo_worker.py) with that interpreter (`--trl-python`, default
$BENCH_TRL_PYTHON or /tmp/benchvenv/bin/python).

Sizes:
  * demo: the demo's base (tools/make_demo_base.py, 165k parameters), 32 prompts x 16 samples, 16-token
    responses, lr 3e-4, 4 optimizer steps per rollout batch: configs/experiment/demo.yaml.
  * large: a ~30M-parameter Qwen2 (hidden 512, 10 layers, FFN 1536, 8 heads, 2 KV heads; character vocab)
    built by the same warm-up with model overrides on `data.task=column_addition` (3-digit sums worked
    column by column: ~110-token responses), 8 prompts x 8 samples, responses up to 128 tokens, lr 2e-5, 4
    optimizer steps per rollout batch; TRL runs 60 rollout steps to this project's 20: TRL needs far more
    steps than this project to reach the target (bench/RESULTS.md, 'Time to accuracy'), and the 3x is room for
    it, so a TRL run that misses the target still bounds the ratio. Building its base takes one to two hours
    on the 2-core machine (done once, kept in outputs/; one that stopped short of its target continues with
    tools/make_demo_base.py --output NEW model.hf_dir=OLD and the same model, task and warm-up overrides), and
    a rollout step takes tens of seconds on either side: not part of bench/run.py's default run
    (`bench/run.py --large`).
Both sides: fp32, loss DAPO token-mean, clip 0.2 / 0.28, no KL, DAPO's scorer plus the soft overlong penalty
over the same buffer, temperature 1, AdamW with constant lr, grad-norm clip 1, the whole machine: TRL with
torch's default intra-op threads (every core, TRL's faster setting at both sizes: bench/RESULTS.md, 'TRL's
threads'; --trl-threads), this project with one thread per process and the next batch generated while the
policy trains (`trainer.overlap_rollout`: the engine on one core, the trainer on the other, each taking both
while the other is idle: `trainer.cpu_idle_cores`, and at the large size `rollout.cpu_idle_cores`).
Differences that stay: TRL generates with `model.generate` in-process, this project with SGLang; this project
takes π_old from the engine's log-probs (`algo.old_log_prob_source=rollout`, as in the demo), TRL recomputes
it; this project runs dynamic sampling (DAPO's, streaming), TRL trains on every group,
including those whose advantages are all zero. So this project runs three times: with dynamic sampling for
accuracy and time-to-accuracy, and for `same_work_steps` steps without it, training every group as TRL
does, for the throughput comparison, once generating ahead and once synchronously (generation only between
updates, as TRL does).

Reported per side (medians over steps, with p10/p90): wall seconds per rollout step (evaluation excluded),
trained samples/s, generated samples/s, generated response tokens/s (this project: estimated from the kept
samples' mean length), informative samples trained per second (samples of groups whose samples disagree, so
their advantages are not all zero: all this project trains, a share of what TRL trains), held-out greedy
accuracy after the same steps, and the wall time, from launch with start-up included and evaluation
excluded, until held-out accuracy first reaches the size's target (demo: 0.4; large: each run's accuracy
before training plus 0.08; --target-acc, --target-gain). Printed last: `e2e_throughput_vs_trl[_demo]`
(trained samples/s, this project without dynamic sampling / TRL: the same work per step),
`e2e_throughput_synchronous_vs_trl[_demo]` (the same without generating ahead),
`e2e_throughput_dynamic_sampling_vs_trl[_demo]` (the same with dynamic sampling), generated tokens/s and
informative samples/s (with dynamic sampling), `time_to_accuracy_vs_trl[_demo]` (this project / TRL;
None when either side did not reach the target; when only this project did,
`time_to_accuracy_vs_trl_upper_bound [_demo]`: its time over TRL's whole evaluated run, which the true ratio
is below), and `startup_s_vs_trl[_demo]` (launch to ready to generate, this project / TRL: TRL's
`on_train_begin`, this project's start-up record after its first weight sync; each side's median over its
accuracy runs, evaluation excluded).

Both sides run their accuracy run once per `--seeds` seed (the seed of the model's sampling, the prompt
order and the trainer's initialisation; the problems stay the base's), and `--repeats N` runs this project's
N times per seed (runs that generate ahead differ by timing even at one seed; TRL's repeat to the digit). A
side's time to accuracy is the upper median over its runs, a run that missed the target counting as slower
than any that reached it, and `time_to_accuracy_reached_runs[_demo]` / `..._trl[_demo]` are the shares of
runs that reached it. The same-work runs and `--pairs` use the first seed. Seed by seed, TRL runs, then this
project, so that each seed's two sides are minutes apart however long the whole call takes.

Every finished run saves its result beside its logs (`NAME.result.json`, with the settings that produced it
and the commit). The ~30M accuracy runs take about an hour per seed: `--keep DIR --resume` repeats a stopped
call and reads back the runs it finished instead of running them again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer_runs import (
    DEMO_BASE,
    REPO,
    Record,
    bench_env,
    describe,
    ensure_base,
    fmt,
    ratio,
    spread,
    tail,
    task_seed,
    train_run,
)

from dapo_megatron.trainer.evaluate import eval_accuracy
from dapo_megatron.trainer.startup import git_commit

LARGE_MODEL = (
    "model.hidden_size=512",
    "model.num_layers=10",
    "model.ffn_hidden_size=1536",
    "model.num_attention_heads=8",
    "model.num_query_groups=2",
)
LARGE_WARMUP = (
    "warmup.eval_mode=teacher_forced",
    "warmup.batch_size=32",
    "warmup.micro_batch_size=32",
    "warmup.lr=1e-3",
    "warmup.eval_every=5",
    "warmup.eval_size=100",
    "warmup.max_steps=600",
    "warmup.target_accuracy=0.2",
)
"""The ~30M base on column addition. The warm-up is noisy at this size: builds with these settings stop at
different steps, and some run out of steps short of the target (bench/RESULTS.md, 'The ~30M base'); check the
base's summary before comparing runs."""


@dataclass(frozen=True)
class Size:
    name: str
    base: Path
    model: tuple[
        str, ...
    ]  # model overrides: the warm-up builds it and the trainer loads it with the same shape
    task: str  # data.task: the warm-up, both trainers' prompts and the held-out problems
    warmup: tuple[str, ...]  # warm-up overrides for building the base (tools/make_demo_base.py)
    prompts: int
    group: int
    mini_batch: int
    max_new_tokens: int
    overlong_buffer: int
    lr: float
    steps: int  # this project's rollout steps in the accuracy run
    trl_steps: (
        int  # TRL's: three times as many at the large size, room for TRL (it needs 50 at seed 0), so a TRL
    )
    # run that misses the target still bounds the ratio
    eval_every: int
    eval_problems: int
    target_acc: float
    same_work_steps: int  # of the run without dynamic sampling that measures throughput on TRL's work
    suffix: str  # of the printed keys
    engine_idle_cores: bool = True  # rollout.cpu_idle_cores: off at the demo size, as in the demo's config
    kv_tokens: int | None = None  # rollout.max_total_tokens, so the engine's KV cache holds every request in
    # flight (None: the demo config's, which holds its own)
    target_gain: float | None = None  # the target is then the run's own evaluation before training plus this:
    # a base that lands elsewhere keeps the same bar above itself (None: target_acc)


SIZES = {
    "demo": Size(
        "demo",
        DEMO_BASE,
        (),
        "addition",
        (),
        prompts=32,
        group=16,
        mini_batch=8,
        max_new_tokens=16,
        overlong_buffer=4,
        lr=3e-4,
        steps=40,
        trl_steps=40,
        eval_every=5,
        eval_problems=200,
        target_acc=0.4,
        same_work_steps=10,
        suffix="_demo",
        engine_idle_cores=False,
    ),
    "large": Size(
        "large",
        REPO / "outputs" / "bench_base_30m_columns",
        LARGE_MODEL,
        "column_addition",
        LARGE_WARMUP,
        prompts=8,
        group=8,
        mini_batch=2,
        max_new_tokens=128,
        overlong_buffer=16,
        lr=2e-5,
        steps=20,
        trl_steps=60,
        eval_every=5,
        eval_problems=200,
        target_acc=0.3,
        same_work_steps=10,
        suffix="",
        kv_tokens=65536,
        target_gain=0.08,
    ),
}
"""The large size's lr and target. At lr 1e-4 both trainers lose held-out accuracy within a few steps; at 2e-5
this project holds or gains it (bench/RESULTS.md, 'Learning rate at ~30M'). 200 held-out problems put the
noise near 0.03 on one evaluation and 0.04 on a difference of two, so the target is the base's own held-out
accuracy (each run's evaluation before training) plus 0.08, about twice the noise of a difference: 0.30 on
the recorded base (0.215). The ~30M warm-up lands between 0.12 and 0.22 from one build to the next (bench/
RESULTS.md, 'The ~30M base'), and a fixed target would ask a different gain of each build."""


def quick(size: Size) -> Size:
    """A smoke test: two tiny rollout steps, a handful of evaluation problems."""
    return replace(
        size,
        prompts=4,
        group=4,
        mini_batch=2,
        steps=2,
        trl_steps=2,
        eval_every=1,
        eval_problems=10,
        max_new_tokens=min(size.max_new_tokens, 32),
        same_work_steps=2,
    )


def ours(
    size: Size,
    scratch: Path,
    args: argparse.Namespace,
    *,
    dynamic_sampling: bool = True,
    overlap: bool = False,
    seed: int | None = None,
    run: int = 0,
) -> dict[str, Any]:
    """This project's run; without `dynamic_sampling` it trains every group, as TRL does (the same work per
    step: the throughput comparison), for `size.same_work_steps` steps without evaluation. `overlap`: the
    next batch is generated while the policy trains (trainer.overlap_rollout). `seed`: the job's (default:
    the first of --seeds); `run` numbers repeats."""
    seed = args.seeds[0] if seed is None else seed
    steps = size.steps if dynamic_sampling else size.same_work_steps
    overrides = [
        f"model.hf_dir={size.base}",
        *size.model,
        f"data.task={size.task}",
        f"data.task_seed={task_seed(size.base)}",
        f"seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.train_batch_size={size.prompts}",
        f"trainer.ppo_mini_batch_size={size.mini_batch}",
        f"trainer.gen_batch_size={size.prompts * 3 // 2}",
        f"rollout.n_samples_per_prompt={size.group}",
        f"rollout.max_response_length={size.max_new_tokens}",
        f"algo.overlong_buffer_length={size.overlong_buffer}",
        f"optim.lr={size.lr}",
        f"eval.every={size.eval_every if dynamic_sampling else 0}",
        f"eval.num_problems={size.eval_problems}",
        "trainer.save_every=0",
        f"trainer.overlap_rollout={str(overlap).lower()}",
        f"rollout.cpu_idle_cores={str(size.engine_idle_cores).lower()}",
    ]
    if size.kv_tokens is not None:
        overrides += [f"rollout.max_total_tokens={size.kv_tokens}"]
    # Without dynamic sampling; and in --quick, where an untrained base rarely yields informative groups and a
    # smoke test must not stall on it.
    if args.quick or not dynamic_sampling:
        overrides += ["trainer.dynamic_sampling=false"]
    name = f"ours_{size.name}{'' if dynamic_sampling else '_same_work'}{'_overlap' if overlap else ''}"
    name += f"_seed{seed}" + (f"_run{run}" if run else "")
    return run_once(
        scratch / name,
        overrides,
        args,
        lambda: our_summary(
            train_run(overrides, scratch / name, timeout=args.timeout), size, dynamic_sampling, args
        ),
    )


def our_summary(
    records: list[Record], size: Size, dynamic_sampling: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """A finished run's metrics records (`trainer_runs.train_run`) as its per-step work and evaluations."""
    trained = size.prompts * size.group
    steps, evals, eval_s = [], [], 0.0
    for record in records:
        m = record.metrics
        eval_s += m.get("timing_s/testing", 0.0)
        if (accuracy := eval_accuracy(m)) is not None:
            evals.append((int(m["step"]), accuracy, record.seconds - eval_s))
        if m["step"] > 0 and "timing_s/step" in m:
            seconds = m["timing_s/step"] - m.get("timing_s/testing", 0.0)
            generated = m.get("dynamic_sampling/samples_per_kept", 1.0) * trained
            steps.append(
                {
                    "seconds": seconds,
                    "trained": trained,
                    "generated": generated,
                    "tokens": generated * m["response_length/mean"],
                    # dynamic sampling trains only groups whose samples disagree (off in --quick); without
                    # it the trainer still logs their share
                    "informative": trained
                    * (1.0 if dynamic_sampling and not args.quick else m["dynamic_sampling/keep_ratio"]),
                }
            )
    startup = records[0].seconds - records[0].metrics.get("timing_s/testing", 0.0)
    return summarise(steps, evals, startup, size)


def trl(size: Size, scratch: Path, args: argparse.Namespace, seed: int | None = None) -> dict[str, Any]:
    """TRL's run at `seed` (default: the first of --seeds), evaluated every `size.eval_every` steps."""
    seed = args.seeds[0] if seed is None else seed
    name = f"trl_{size.name}_seed{seed}"
    out = scratch / f"{name}.jsonl"
    command = [
        args.trl_python,
        str(REPO / "bench" / "trl_dapo_worker.py"),
        f"--base={size.base}",
        f"--out={out}",
        f"--task={size.task}",
        f"--task-seed={task_seed(size.base)}",
        f"--steps={size.trl_steps}",
        f"--prompts={size.prompts}",
        f"--group={size.group}",
        f"--mini-batch={size.mini_batch}",
        f"--max-new-tokens={size.max_new_tokens}",
        f"--overlong-buffer={size.overlong_buffer}",
        f"--lr={size.lr}",
        f"--eval-every={size.eval_every}",
        f"--eval-problems={size.eval_problems}",
        f"--seed={seed}",
    ]
    # The saved run's settings are the worker's arguments: the interpreter and the checkout may move between
    # the calls of a resumed benchmark.
    return run_once(
        scratch / name, command[2:], args, lambda: trl_run(command, out, scratch / f"{name}.log", size, args)
    )


def trl_run(command: list[str], out: Path, log: Path, size: Size, args: argparse.Namespace) -> dict[str, Any]:
    launched = time.time()
    with log.open("w") as f:
        code = subprocess.run(
            command,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=bench_env(args.trl_threads),
            timeout=args.timeout,
        ).returncode
    if code != 0:
        raise RuntimeError(f"TRL run exited with {code}; end of its log:\n{tail(log)}")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps, evals = trl_progress(lines, launched)
    # The first record is stamped after the evaluation before training: start-up ends where that began.
    return summarise(steps, evals, lines[0]["time"] - launched - lines[0]["eval_s"], size)


def run_once(
    where: Path, spec: list[str], args: argparse.Namespace, run: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """`run()`'s result, saved beside the run (`where`.result.json) with the `spec` that produced it (the
    trainer's overrides or TRL's command) and the commit. With `--resume`, a saved result of the same spec is
    read back instead: a benchmark of hours stopped part-way goes on from its last finished run."""
    saved = where.with_name(f"{where.name}.result.json")
    if args.resume and saved.exists():
        kept = json.loads(saved.read_text())
        if kept["spec"] != spec:
            raise SystemExit(
                f"{saved} was run with other settings than this one's; remove it (or pass another --keep) to "
                f"run it again. Saved: {kept['spec']}; now: {spec}"
            )
        print(f"{where.name}: the finished run in {saved} (commit {kept['commit']})", flush=True)
        return kept["result"]
    result = run()
    partial = saved.with_suffix(".partial")  # a call killed while writing leaves no half a result to resume
    partial.write_text(json.dumps({"spec": spec, "commit": git_commit(REPO), "result": result}, indent=1))
    partial.replace(saved)
    return result


def trl_progress(
    lines: list[dict[str, Any]], launched: float
) -> tuple[list[dict[str, float]], list[tuple[int, float, float]]]:
    """The TRL worker's records (one per rollout step boundary, `trl_dapo_worker.py`) as per-step work and
    (step, accuracy, seconds since `launched`) evaluations, every evaluation's own time left out. A record is
    stamped after that step's evaluation, and its `eval_s` counts it: the time at which the evaluated weights
    existed is the stamp less every evaluation so far."""
    steps, evals = [], []
    for before, after in itertools.pairwise(lines):
        generated = after["samples"] - before["samples"]
        steps.append(
            {
                "seconds": after["time"] - before["time"] - (after["eval_s"] - before["eval_s"]),
                "trained": generated,
                "generated": generated,
                "tokens": after["tokens"] - before["tokens"],
                "informative": after["informative"] - before["informative"],
            }
        )
    for line in lines:
        if line["eval_accuracy"] is not None:
            evals.append((line["step"], line["eval_accuracy"], line["time"] - launched - line["eval_s"]))
    return steps, evals


def rates(steps: list[dict[str, float]]) -> dict[str, Any]:
    # Each step's own rates, then the median over steps: one slow stretch of the shared machine moves the
    # spread, not the answer.
    return {
        "step_seconds": spread([s["seconds"] for s in steps]),
        "trained_samples_per_s": spread([s["trained"] / s["seconds"] for s in steps]),
        "generated_samples_per_s": spread([s["generated"] / s["seconds"] for s in steps]),
        "generated_tokens_per_s": spread([s["tokens"] / s["seconds"] for s in steps]),
        "informative_samples_per_s": spread([s["informative"] / s["seconds"] for s in steps]),
    }


def summarise(
    steps: list[dict[str, float]], evals: list[tuple[int, float, float]], startup: float, size: Size
) -> dict[str, Any]:
    target = size.target_acc
    if size.target_gain is not None and evals and evals[0][0] == 0:
        target = round(evals[0][1] + size.target_gain, 6)  # accuracies are multiples of 1 / problems
    reached = next(((step, seconds) for step, acc, seconds in evals if acc >= target), None)
    return {
        **rates(steps),
        "steps": steps,
        "startup_seconds": startup,
        "eval_accuracy": [(step, acc) for step, acc, _ in evals],
        "eval_seconds": [seconds for _, _, seconds in evals],  # since launch, evaluation excluded
        "final_eval_accuracy": evals[-1][1] if evals else None,
        "target_accuracy": target,
        "reached_at_step": reached[0] if reached else None,
        "time_to_accuracy_s": reached[1] if reached else None,
    }


def over_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one side's accuracy run as one result. Time to accuracy is the upper median over runs, a run
    that never reached the target counting as later than any that did: None unless more than half of the runs
    reached it (of two, the slower). `reached_runs` is the share that reached it; the rates are medians over
    every run's steps; the accuracies are the median run's; the start-up is the median over runs."""

    def reached_in(run: dict[str, Any]) -> float:
        return math.inf if run["time_to_accuracy_s"] is None else run["time_to_accuracy_s"]

    median_run = sorted(runs, key=reached_in)[len(runs) // 2]
    pooled = [step for r in runs for step in r["steps"]]
    return {
        **median_run,
        **rates(pooled),
        "steps": pooled,
        "startup_seconds": statistics.median(r["startup_seconds"] for r in runs),
        "reached_runs": sum(math.isfinite(reached_in(r)) for r in runs) / len(runs),
        "runs": runs,
    }


def throughput_pairs(size: Size, scratch: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--pairs`: TRL and this project doing the same work (every group trained) for `same_work_steps` rollout
    steps each, one right after the other, `args.pairs` times: this project generating ahead (`ratio`) and
    synchronously, on policy as TRL is (`synchronous_ratio`). Each pair's ratios are measured minutes apart,
    so the machine's drift over hours moves the pairs, not a ratio. No accuracy runs (TRL evaluates 20
    problems at its first and last step only, outside the timed steps)."""
    size = replace(size, trl_steps=size.same_work_steps, eval_every=size.same_work_steps, eval_problems=20)
    pairs = []
    for i in range(args.pairs):
        folder = scratch / f"pair{i}"
        folder.mkdir(parents=True, exist_ok=True)
        theirs = trl(size, folder, args)
        mine = ours(size, folder, args, dynamic_sampling=False, overlap=True)
        synchronous = ours(size, folder, args, dynamic_sampling=False)
        theirs_rate = theirs["trained_samples_per_s"]["median"]
        pairs.append(
            {
                "trl": theirs,
                "ours_same_work": mine,
                "ours_same_work_synchronous": synchronous,
                "ratio": ratio(mine["trained_samples_per_s"]["median"], theirs_rate),
                "synchronous_ratio": ratio(synchronous["trained_samples_per_s"]["median"], theirs_rate),
            }
        )
        print(
            f"{size.name} pair {i}: TRL {describe('s/step', theirs['step_seconds'])}; ours "
            f"{describe('s/step', mine['step_seconds'])}, synchronous "
            f"{describe('s/step', synchronous['step_seconds'])}; e2e_throughput_vs_trl "
            f"{fmt(pairs[-1]['ratio'])}, synchronous {fmt(pairs[-1]['synchronous_ratio'])}",
            flush=True,
        )
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, help="rollout steps per run, both sides (default: per size)")
    parser.add_argument("--trl-steps", type=int, help="TRL's rollout steps (default: --steps, else per size)")
    parser.add_argument(
        "--target-acc", type=float, help="held-out accuracy for time-to-accuracy (default: per size)"
    )
    parser.add_argument(
        "--target-gain",
        type=float,
        help="time to accuracy counts to each run's accuracy before training plus this (default: per size; "
        "the large size's 0.08)",
    )
    parser.add_argument("--demo-base", type=Path, default=SIZES["demo"].base)
    parser.add_argument("--large-base", type=Path, default=SIZES["large"].base)
    parser.add_argument(
        "--trl-python", default=os.environ.get("BENCH_TRL_PYTHON", "/tmp/benchvenv/bin/python")
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="each side's accuracy run, once per seed (time to accuracy: the median over them); the "
        "same-work runs and --pairs use the first",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=os.cpu_count(),
        help="TRL's OMP_NUM_THREADS (default: every core, torch's own default, TRL's fastest here)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="this project's accuracy run, this many times per seed (generating ahead, which groups a "
        "batch keeps depends on timing, so runs of one seed differ); time to accuracy is the upper "
        "median over runs. TRL's run is deterministic at a seed and runs once per seed",
    )
    parser.add_argument(
        "--same-work-steps",
        type=int,
        help="rollout steps of the same-work (throughput) runs (default: per size)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="throughput only: this many TRL / this project same-work pairs (generating ahead and "
        "synchronously), one right after the other; no accuracy runs. e2e_throughput_vs_trl and "
        "e2e_throughput_synchronous_vs_trl are then the lower medians of the pairs' ratios",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per training run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 tiny steps per side; the large base gets 2 warm-up steps only",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="with --keep: read back the runs a stopped call of the same command finished there, and run "
        "only the rest",
    )
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument(
        "--keep",
        type=Path,
        help="write the runs' logs and metrics here (default: a temporary directory, removed at the end)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(
            f"--repeats must be at least 1 (this project's accuracy run, that many times); got {args.repeats}"
        )
    if args.pairs < 0:
        parser.error(f"--pairs must be at least 0 (0: the accuracy and throughput runs); got {args.pairs}")
    if args.resume and args.keep is None:
        parser.error("--resume reads the finished runs of an earlier call from --keep DIR: pass that --keep")
    if not Path(args.trl_python).exists():
        parser.error(f"no TRL environment at {args.trl_python}: create it as the docstring says (--help)")

    results: dict[str, Any] = {}
    summary: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.keep or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        for name in args.sizes:
            size = replace(SIZES[name], base=args.demo_base if name == "demo" else args.large_base)
            warmup = (*size.model, *size.warmup)
            if args.quick:
                size = quick(size)
                if name == "large":  # 2 warm-up steps: a shape check of the whole path, not a policy
                    size = replace(size, base=scratch / "large_base")
                    warmup += ("warmup.max_steps=2", "warmup.eval_size=8")
            size = replace(
                size,
                steps=args.steps or size.steps,
                trl_steps=args.trl_steps or args.steps or size.trl_steps,
                target_acc=args.target_acc or size.target_acc,
                target_gain=None if args.target_acc else (args.target_gain or size.target_gain),
                same_work_steps=args.same_work_steps or size.same_work_steps,
            )
            ensure_base(size.base, warmup, task=size.task)
            config = {k: str(v) for k, v in vars(size).items()}
            if args.pairs:
                pairs = throughput_pairs(size, scratch, args)
                results[name] = {"config": config, "pairs": pairs}
                for key, name in (
                    ("ratio", "e2e_throughput"),
                    ("synchronous_ratio", "e2e_throughput_synchronous"),
                ):
                    ratios = sorted(pair[key] for pair in pairs)
                    summary[f"{name}_vs_trl_lowest_pair{size.suffix}"] = ratios[0]
                    summary[f"{name}_vs_trl{size.suffix}"] = ratios[(len(ratios) - 1) // 2]  # lower median
                continue
            # Per seed TRL, then ours, so that one seed's two sides run minutes apart (the machine drifts
            # over hours); never both at once (two cores). Ours generates ahead (trainer.overlap_rollout: the
            # engine on one core, the trainer on the other), and once without, for comparison.
            trl_runs, our_runs = [], []
            for seed in args.seeds:
                trl_runs.append(trl(size, scratch, args, seed))
                our_runs += [
                    ours(size, scratch, args, overlap=True, seed=seed, run=i) for i in range(args.repeats)
                ]
            results[name] = {
                "config": config,
                "trl": over_runs(trl_runs),
                "ours": over_runs(our_runs),
                "ours_same_work": ours(size, scratch, args, dynamic_sampling=False, overlap=True),
                "ours_same_work_synchronous": ours(size, scratch, args, dynamic_sampling=False),
            }
            theirs, mine, same = results[name]["trl"], results[name]["ours"], results[name]["ours_same_work"]
            synchronous = results[name]["ours_same_work_synchronous"]
            several = len(mine["runs"]) > 1
            runs = [
                (f"{side} (run {i})", run)
                for side, result in (("trl", theirs), ("ours", mine))
                for i, run in enumerate(result["runs"])
                if several
            ]
            for side, r in (
                (f"trl (median run of {len(theirs['runs'])})" if several else "trl", theirs),
                (f"ours (median run of {len(mine['runs'])})" if several else "ours", mine),
                *runs,
                ("ours without dynamic sampling", same),
                ("ours without dynamic sampling, synchronous", synchronous),
            ):
                print(
                    f"{name} {side} {describe('s/step', r['step_seconds'])}; "
                    f"{describe('trained samples/s', r['trained_samples_per_s'])}; "
                    f"{describe('generated tokens/s', r['generated_tokens_per_s'])}; "
                    f"{describe('informative samples/s', r['informative_samples_per_s'])}; start-up "
                    f"{r['startup_seconds']:.1f}s; eval acc {r['eval_accuracy']}; time to "
                    f"{r['target_accuracy']}: {r['time_to_accuracy_s']}"
                )
            # The same work per step as TRL (every group trained): what the trainer itself turns out.
            summary[f"e2e_throughput_vs_trl{size.suffix}"] = ratio(
                same["trained_samples_per_s"]["median"], theirs["trained_samples_per_s"]["median"]
            )
            # The same work, generating only between updates.
            summary[f"e2e_throughput_synchronous_vs_trl{size.suffix}"] = ratio(
                synchronous["trained_samples_per_s"]["median"], theirs["trained_samples_per_s"]["median"]
            )
            # DAPO as run (dynamic sampling generates until the batch holds only informative groups).
            summary[f"e2e_throughput_dynamic_sampling_vs_trl{size.suffix}"] = ratio(
                mine["trained_samples_per_s"]["median"], theirs["trained_samples_per_s"]["median"]
            )
            summary[f"e2e_generated_tokens_per_s_vs_trl{size.suffix}"] = ratio(
                mine["generated_tokens_per_s"]["median"], theirs["generated_tokens_per_s"]["median"]
            )
            summary[f"e2e_informative_samples_per_s_vs_trl{size.suffix}"] = ratio(
                mine["informative_samples_per_s"]["median"], theirs["informative_samples_per_s"]["median"]
            )
            summary[f"time_to_accuracy_vs_trl{size.suffix}"] = ratio(
                mine["time_to_accuracy_s"], theirs["time_to_accuracy_s"]
            )
            summary[f"time_to_accuracy_reached_runs{size.suffix}"] = mine["reached_runs"]
            summary[f"time_to_accuracy_reached_runs_trl{size.suffix}"] = theirs["reached_runs"]
            summary[f"startup_s_vs_trl{size.suffix}"] = ratio(
                mine["startup_seconds"], theirs["startup_seconds"]
            )
            # TRL never reached the target but this project did: TRL's time is longer than its whole evaluated
            # run, so the ratio is below this bound (None stays None: a bound is not a measurement).
            if (
                mine["time_to_accuracy_s"] is not None
                and theirs["time_to_accuracy_s"] is None
                and theirs["eval_seconds"]
            ):
                summary[f"time_to_accuracy_vs_trl_upper_bound{size.suffix}"] = ratio(
                    mine["time_to_accuracy_s"], theirs["eval_seconds"][-1]
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"quick": args.quick, "sizes": results, **summary}, indent=2))
    # The headline ratios last, as bench/run.py reads them.
    for key in sorted(summary, key=lambda k: (not k.startswith("e2e_generated"), k)):
        print(f"{key} {fmt(summary[key])}")


if __name__ == "__main__":
    main()
