#!/usr/bin/env python
"""Run this first on a new GPU machine: the trainer's GPU paths, each one checked and timed, in a few minutes.

    python tools/gpu_check.py [--steps 5] [--batch-size 8] [--seq-length 2048] [--skip-engine]
        [hydra overrides]
    torchrun --nproc-per-node 8 tools/gpu_check.py model=qwen2.5-7b parallel.tensor_model_parallel_size=4

Stages, one line each (`ok`, `skipped: why`, or `FAILED: error`), on a Qwen2 policy with random weights
(Qwen2.5-0.5B's shapes unless `model=...`; nothing is downloaded):

1. environment: torch, CUDA, the GPU, megatron-core, Transformer Engine, SGLang; that the CPU compatibility
   layer is off (megatron-core runs untouched on CUDA).
2. bf16: DAPO training steps through the trainer's own path (megatron DDP, the optimizer, `Actor.train_step`:
   the DAPO loss through megatron-core's schedule): step time, tokens/s, MFU (`dapo_megatron/flops.py`),
   peak memory.
3. log-probs: the chunked vocab-parallel log-prob/entropy kernel against the naive full-vocab computation on
   the model's vocabulary: largest difference, and the peak memory of each (forward + backward).
4. fp8: the same steps with Transformer Engine FP8 layers (`model.fp8.*`, `enabled` forced on); needs TE and a
   Hopper-or-newer GPU.
5. param-gather: the distributed optimizer with `parallel.overlap_param_gather` (the 7B and 32B recipes)
   defers the all-gather of updated parameters to the next forward; the weights every reader outside a
   forward sees (the weight sync, checkpoints, exports) must be the optimizer's new ones, as without the
   flag. Needs data parallelism (several processes).
6. checkpoint: a checkpoint as the trainer writes it (model, optimizer, schedule, RNG), read back into a
   freshly built policy, which then makes the same next step as the policy that wrote it; save and load
   times and sizes.
7. engine: the policy exported to Hugging Face format, loaded back through the trainer's HF path, a colocated
   SGLang engine started as the trainer starts it, its memory released for a training step and resumed, the
   new weights pushed (`rollout.sync_method`), and the engine's log-probs on a probe batch compared with the
   trainer's; then a short generation. Needs SGLang.

Every stage runs in the environment of the cluster's `slurm/env.sh` (`--slurm-env`), as a job does: the
variables it sets are applied before CUDA starts, and the environment stage lists them. `--stages` picks
stages by name. It runs what this machine can and says what it skipped and why: a machine with only a CUDA
build of torch and megatron-core runs stages 1-3, 5 and 6. Exit status: 0 when no stage failed, 1 when one
did, 2 without a GPU. `--allow-cpu` runs the same stages on the CPU in fp32 (for tests and laptops: no MFU,
no GPU memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from dapo_megatron import config as job_config
from dapo_megatron import flops
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models import fp8
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.trainer.actor import Actor, PolicyRows
from dapo_megatron.versions import package_version

DEFAULT_MODEL = "qwen2.5-0.5b"
REPO = Path(__file__).resolve().parent.parent
SLURM_ENV = REPO / "slurm" / "env.sh"
ENGINE_OVERRIDES = (
    "rollout.max_prompt_length=64",
    "rollout.max_response_length=16",
    "eval.num_problems=8",
    "eval.samples_per_problem=1",
    "eval.temperature=0.0",
    "rollout.sync_check=always",
    "trainer.offload_during_rollout=true",
)
"""The engine stage's rollouts: a few short greedy generations, so the stage is about start-up and sync,
with the trainer's state offloaded as the 32B recipe does: the policy's state leaves before the engine
sizes its KV cache, comes back for the update, and leaves again mid-sync (the probe's check after it)."""
BF16_SYNC_TOLERANCE = 0.05
"""Engine against trainer, both bf16 with different kernels, unless `rollout.sync_check_tolerance` is given:
the log-probs of a random policy sit near -log(vocab), and bf16 logits differ by about 1e-3 relative."""
GIB = 2.0**30
LARGE_STEP = {"lr": 1e-2, "lr_warmup_rollout_steps": 0}
"""The optimizer of the param-gather and checkpoint stages: a first step that moves every bf16 weight by many
units in its last place, so that a stale or lost update shows (the recipes' warmed-up 1e-6 moves none)."""
GPU_WEIGHT_TOLERANCE = 1e-3
"""Two identical steps on a GPU may differ by the rounding of non-deterministic kernels (atomic adds in the
embedding's backward): a few bf16 units in the last place at the weights' ~0.02 scale. On CPU: equal."""


class Skip(Exception):
    """A stage that cannot run on this machine; the message says why."""


@dataclasses.dataclass
class Check:
    """What the stages share: the job, this process's layout, and the command line."""

    job: JobConfig
    layout: ParallelLayout
    args: argparse.Namespace
    workdir: Path
    cluster_env: dict[str, str] = dataclasses.field(default_factory=dict)
    """What `--slurm-env` set in this process's environment."""

    @property
    def on_gpu(self) -> bool:
        return self.layout.device.type == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.on_gpu else "fp32"

    def policy_config(self, *, fp8_enabled: bool = False) -> ModelConfig:
        return dataclasses.replace(
            self.job.model,
            params_dtype="bfloat16" if self.on_gpu else "float32",
            fp8=dataclasses.replace(self.job.model.fp8, enabled=fp8_enabled),
        )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed optimizer steps per precision (after 1 untimed)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per optimizer step on each DP rank"
    )
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument(
        "--seq-length", type=int, default=2048, help="tokens per sequence (half prompt, half response)"
    )
    parser.add_argument(
        "--logprob-tokens", type=int, default=4096, help="tokens in the log-prob kernel check"
    )
    parser.add_argument("--skip-engine", action="store_true", help="leave out the SGLang engine stage")
    parser.add_argument(
        "--workdir",
        help="where the engine stage writes its HF export (default: the system's "
        "temporary directory; on several nodes, a shared filesystem)",
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible (fp32)"
    )
    parser.add_argument(
        "--slurm-env",
        default=str(SLURM_ENV),
        help="the cluster's environment file, sourced as the job scripts source it ('' for none)",
    )
    parser.add_argument("--stages", help="comma-separated stage names to run (default: all)")
    args, overrides = parser.parse_known_args(argv)
    unknown = set((args.stages or "").split(",")) - set(STAGES) - {""}
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(sorted(unknown))}; the stages are {', '.join(STAGES)}")
    if (
        args.steps < 1
        or args.batch_size < 1
        or args.seq_length < 4
        or args.batch_size % args.micro_batch_size
    ):
        parser.error(
            "--steps and --batch-size must be >= 1, --seq-length >= 4, and --batch-size a multiple of "
            "--micro-batch-size"
        )
    return args, overrides


def random_rows(batch_size: int, seq_length: int, vocab_size: int, seed: int) -> PolicyRows:
    """Random prompts + responses: the response is the second half, advantages are +-1."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length), generator=generator)
    response_mask = torch.zeros(batch_size, seq_length - 1)
    response_mask[:, seq_length // 2 :] = 1.0
    advantages = torch.randint(0, 2, (batch_size,), generator=generator).float() * 2 - 1
    return PolicyRows(tokens=tokens, response_mask=response_mask, advantages=advantages)


def _synchronize(check: Check) -> None:
    if check.on_gpu:
        torch.cuda.synchronize()


def _reset_peak(check: Check) -> None:
    if check.on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(check: Check) -> str:
    return (
        f"peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB"
        if check.on_gpu
        else "peak memory: CUDA only"
    )


def cluster_environment(path: Path) -> dict[str, str]:
    """The variables the cluster's environment file (`slurm/env.sh`) sets or changes, sourced from the
    repository root over this process's environment, as the job scripts source it."""

    def environment(script: str) -> dict[str, str]:
        listed = subprocess.run(
            ["bash", "-c", script, "gpu_check", str(path)], cwd=REPO, capture_output=True, check=True
        ).stdout
        return dict(item.split("=", 1) for item in listed.decode().split("\0") if "=" in item)

    before = environment("env -0")
    after = environment('source "$1" >/dev/null && env -0')
    return {key: value for key, value in after.items() if before.get(key) != value}


# ---------------------------------------------------------------------------------------------------- stages


def stage_environment(check: Check) -> str:
    from dapo_megatron.backends import cpu_compat

    if check.on_gpu and cpu_compat.active():
        raise RuntimeError(
            "the CPU compatibility layer is active on a CUDA machine: megatron-core would run on "
            "redirected devices"
        )
    versions = {
        "torch": torch.__version__,
        "megatron-core": package_version("megatron-core"),
        "transformer-engine": package_version("TE"),
        "sglang": package_version("SGLang"),
    }
    parts = [f"{name} {version or 'not installed'}" for name, version in versions.items()]
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: SGLang's memory saver refuses to start "
            "with it, and CUDA IPC of such memory needs pidfd_getfd, which unprivileged containers deny; "
            "unset it"
        )
    names = sorted(check.cluster_env)
    parts.append(
        f"{check.args.slurm_env} set {len(names)} variables ({', '.join(names)})"
        if check.args.slurm_env
        else "no cluster environment file (--slurm-env '')"
    )
    if check.on_gpu:
        major, minor = torch.cuda.get_device_capability()
        parts.insert(
            1,
            f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()} "
            f"(compute capability {major}.{minor}, "
            f"{torch.cuda.get_device_properties(0).total_memory / GIB:.0f} GiB)",
        )
    else:
        parts.insert(
            1,
            f"CPU ({torch.get_num_threads()} threads), CPU compatibility layer "
            f"{'on' if cpu_compat.active() else 'off'}",
        )
    return "; ".join(parts)


def build_actor(
    check: Check, model_cfg: ModelConfig, parallel: ParallelConfig | None = None, *, large_step: bool = False
) -> Actor:
    """A policy as `trainer/policy.py` builds it (megatron DDP, the job's optimizer and schedule; with
    `large_step`, the optimizer of `LARGE_STEP`)."""
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training

    job, layout, parallel = check.job, check.layout, parallel or check.job.parallel
    optim = dataclasses.replace(job.optim, **LARGE_STEP) if large_step else job.optim
    model = wrap_for_training(build_gpt_model(model_cfg, parallel, layout), parallel)
    optimizer, scheduler = build_optimizer(model, optim, parallel, model_cfg, job.trainer.optimizer_steps)
    return Actor(model, optimizer, scheduler, job.algo, layout, vocab_size=model_cfg.vocab_size)


def rank_rows(check: Check, model_cfg: ModelConfig) -> PolicyRows:
    """This data-parallel rank's batch of `--batch-size` random rows."""
    args, seed = check.args, check.job.seed + check.layout.dp_rank
    return random_rows(args.batch_size, args.seq_length, model_cfg.vocab_size, seed=seed)


def train_steps(check: Check, model_cfg: ModelConfig, precision: str) -> str:
    """Median seconds of `--steps` optimizer steps (after one untimed) and what they achieved."""
    layout, args = check.layout, check.args
    _reset_peak(check)
    actor = build_actor(check, model_cfg)
    model, optimizer = actor.model, actor.optimizer
    rows = rank_rows(check, model_cfg)
    times = []
    for _ in range(args.steps + 1):
        _synchronize(check)
        started = time.perf_counter()
        metrics = actor.train_step(rows, args.micro_batch_size)
        _synchronize(check)
        times.append(time.perf_counter() - started)
    peak = _peak(check)
    del actor, model, optimizer
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    lengths = [args.seq_length] * args.batch_size * layout.dp_size
    tokens_per_s = sum(lengths) / seconds
    line = (
        f"{seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s ({tokens_per_s / layout.world_size:,.0f} "
        f"per device), pg_loss {metrics['pg_loss']:.4f}, grad_norm {metrics['grad_norm']:.3f}, {peak}"
    )
    if not check.on_gpu:
        return line
    peak_tflops = flops.peak_tflops(torch.cuda.get_device_name(), precision)
    if peak_tflops is None:
        return (
            f"{line}; MFU unknown: no {precision} peak for {torch.cuda.get_device_name()} in "
            "flops.PEAK_TFLOPS"
        )
    utilisation = flops.mfu(
        flops.training_flops(model_cfg, lengths),
        seconds,
        num_gpus=layout.world_size,
        peak_tflops_per_gpu=peak_tflops,
    )
    return f"{line}; MFU {utilisation:.1%} of {peak_tflops:.0f} TFLOP/s"


def stage_train(check: Check) -> str:
    return train_steps(check, check.policy_config(), check.precision)


def stage_logprobs(check: Check) -> str:
    """The kernel the loss uses against `reference_logprobs`, on this rank's device, unsharded."""
    from dapo_megatron.algo.logprobs import reference_logprobs, vocab_parallel_logprobs

    device, vocab = check.layout.device, check.job.model.vocab_size
    dtype = torch.bfloat16 if check.on_gpu else torch.float32
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(check.args.logprob_tokens, vocab, generator=generator) * 3).to(device, dtype)
    labels = torch.randint(0, vocab, (check.args.logprob_tokens,), generator=generator).to(device)
    results = {}
    for name, fn in (("naive", reference_logprobs), ("chunked", vocab_parallel_logprobs)):
        leaf = logits.detach().requires_grad_()
        _reset_peak(check)
        before = torch.cuda.memory_allocated() if check.on_gpu else 0
        _synchronize(check)
        started = time.perf_counter()
        log_prob, entropy = fn(leaf, labels, temperature=0.9)
        (log_prob.sum() + entropy.sum()).backward()
        _synchronize(check)
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() - before if check.on_gpu else None
        results[name] = (log_prob.detach().float(), leaf.grad.float(), seconds, peak)
        del log_prob, entropy, leaf
    (naive_lp, naive_grad, naive_s, naive_peak), (lp, grad, chunked_s, chunked_peak) = (
        results["naive"],
        results["chunked"],
    )
    lp_gap, grad_gap = (lp - naive_lp).abs().max().item(), (grad - naive_grad).abs().max().item()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if not (lp_gap <= tolerance and grad_gap <= tolerance):
        raise RuntimeError(
            f"the chunked kernel differs from the naive computation: log-prob by {lp_gap:.3g}, "
            f"gradient by {grad_gap:.3g} (tolerance {tolerance:g})"
        )
    line = (
        f"[{check.args.logprob_tokens}, {vocab}] {dtype}: max |diff| log-prob {lp_gap:.2e}, grad "
        f"{grad_gap:.2e}; fwd+bwd {chunked_s * 1e3:.0f} ms vs naive {naive_s * 1e3:.0f} ms"
    )
    if naive_peak is None:
        return f"{line}; peak memory: CUDA only (bench/bench_logprobs.py measures it on CPU)"
    return (
        f"{line}; peak above inputs {chunked_peak / GIB:.2f} GiB vs naive {naive_peak / GIB:.2f} GiB "
        f"({chunked_peak / naive_peak:.2f}x)"
    )


def stage_fp8(check: Check) -> str:
    model_cfg = check.policy_config(fp8_enabled=True)
    try:
        job_config.validate(dataclasses.replace(check.job, model=model_cfg), check.layout.world_size)
        fp8.check_environment(
            model_cfg.fp8, fp8.detect_environment(), transformer_impl=model_cfg.transformer_impl
        )
    except (job_config.ConfigError, RuntimeError) as error:
        raise Skip(str(error)) from error
    return train_steps(check, model_cfg, "fp8")


def stage_engine(check: Check) -> str:
    """The colocated engine as the trainer runs it: start, release, train, resume, push, compare, generate."""
    if check.args.skip_engine:
        raise Skip("--skip-engine")
    if importlib.util.find_spec("sglang") is None:
        raise Skip("SGLang is not installed (requirements-sglang.txt, README 'Clusters')")
    from dapo_megatron.data import char_tokenizer
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import export_hf
    from dapo_megatron.train import launch_engine_first
    from dapo_megatron.trainer.setup import Session

    layout = check.layout
    hf_dir = check.workdir / "policy_hf"
    # A random policy exported as the HF directory a job starts from; the character tokenizer stands in for
    # Qwen's (prompts and probes are token ids either way; nothing is downloaded).
    model_cfg = dataclasses.replace(check.policy_config(), hf_dir=str(hf_dir))
    if layout.is_logging_rank:
        char_tokenizer.save(check.workdir / "tokenizer")
    torch.distributed.barrier()
    export_hf(
        build_gpt_model(model_cfg, check.job.parallel, layout),
        model_cfg,
        layout,
        hf_dir,
        tokenizer_dir=check.workdir / "tokenizer",
    )
    torch.distributed.barrier()
    overrides = [
        *check.args.overrides,
        *ENGINE_OVERRIDES,
        f"model.hf_dir={hf_dir}",
        f"output_dir={check.workdir / 'engine_run'}",
        "trainer.resume=never",
        f"model.params_dtype={model_cfg.params_dtype}",
    ]
    if check.on_gpu and not any(o.startswith("rollout.sync_check_tolerance=") for o in overrides):
        overrides.append(f"rollout.sync_check_tolerance={BF16_SYNC_TOLERANCE}")
    job = job_config.load(overrides, world_size=layout.world_size)
    timings = {}
    started = time.perf_counter()
    with Session(job, layout, lambda: layout, launch_engine_first(job, layout)) as session:
        fleet, actor, client = session.fleet, session.policy.actor, session.rollouts.client
        timings["start"] = time.perf_counter() - started
        fleet.release_memory()
        session.policy.reload_state()
        rows = random_rows(check.args.micro_batch_size, 64, len(char_tokenizer.VOCAB), seed=job.seed)
        actor.train_step(rows, check.args.micro_batch_size)
        sync = fleet.sync_weights(actor, client, 1, offload=session.policy.offload_state)
        timings["sync"] = sync.seconds
        gap = sync.probe_gap or 0.0
        started = time.perf_counter()
        metrics = session.rollouts.evaluate()
        timings["generate"] = time.perf_counter() - started
    lengths = [value for name, value in metrics.items() if "/response_length/mean@" in name]
    generated = (
        f", {job.eval.num_problems} greedy generations (mean length {lengths[0]:.1f})" if lengths else ""
    )
    return (
        f"started in {timings['start']:.0f} s, weights pushed and checked in {timings['sync']:.1f} s "
        f"({job.rollout.sync_method}), probe log-probs within {gap:.2e} of the trainer's "
        f"(tolerance {job.rollout.sync_check_tolerance:g}){generated} in {timings['generate']:.1f} s"
    )


def local_weights(actor: Actor) -> dict[str, torch.Tensor]:
    from dapo_megatron.models.weights import unwrap_model

    named = unwrap_model(actor.model).named_parameters()
    return {name: param.detach().float().clone() for name, param in named}


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| over every tensor of every rank (collective)."""
    local = max(float((a[name] - b[name]).abs().max()) for name in a)
    gap = torch.tensor([local], device=next(iter(a.values())).device)
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    return float(gap)


def weight_tolerance(check: Check) -> float:
    return GPU_WEIGHT_TOLERANCE if check.on_gpu else 0.0


def stage_param_gather(check: Check) -> str:
    """Two policies from the same weights make the same step, the distributed optimizer's parameter all-gather
    deferred (`parallel.overlap_param_gather`) in one and done inside the step in the other; what a reader of
    the weights sees after `finish_param_gather` must not differ."""
    from dapo_megatron.models.weights import finish_param_gather

    if check.layout.dp_size < 2:
        raise Skip("needs data parallelism: run it under torchrun with more ranks than TP x PP")
    model_cfg = check.policy_config()
    deferred = dataclasses.replace(
        check.job.parallel,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    synchronous = dataclasses.replace(deferred, overlap_param_gather=False)
    actors = [build_actor(check, model_cfg, layout, large_step=True) for layout in (deferred, synchronous)]
    with torch.no_grad():
        for mine, theirs in zip(actors[1].model.parameters(), actors[0].model.parameters(), strict=True):
            mine.copy_(theirs)
    actors[1].optimizer.reload_model_params()
    rows = rank_rows(check, model_cfg)
    for actor in actors:
        actor.train_step(rows, check.args.micro_batch_size)
    stale = largest_gap(local_weights(actors[0]), local_weights(actors[1]))
    finish_param_gather(actors[0].model)
    gap = largest_gap(local_weights(actors[0]), local_weights(actors[1]))
    if gap > weight_tolerance(check) or stale <= weight_tolerance(check):
        raise RuntimeError(
            f"after the deferred all-gather the weights differ by {gap:.3g} from the synchronous step's "
            f"(before it: {stale:.3g}; a reader must see the update, and the case must show one)"
        )
    return (
        f"weights within {gap:.2g} of the synchronous step's after the gather (up to {stale:.3g} before it), "
        f"DP {check.layout.dp_size}"
    )


def stage_checkpoint(check: Check) -> str:
    """Save after a step, load into a freshly built policy, take the next step in both: same loss, weights."""
    from dapo_megatron import checkpoint

    layout, model_cfg = check.layout, check.policy_config()
    root = check.workdir / "checkpoints"
    writer = build_actor(check, model_cfg, large_step=True)
    rows = rank_rows(check, model_cfg)
    writer.train_step(rows, check.args.micro_batch_size)
    _synchronize(check)
    started = time.perf_counter()
    directory = checkpoint.save_model(
        writer.model, root, 1, model_cfg, layout, training=writer, shared_state={"step": 1}
    )
    saved_s = time.perf_counter() - started
    reader = build_actor(check, model_cfg, large_step=True)
    started = time.perf_counter()
    checkpoint.load_model(reader.model, root)
    checkpoint.load_training_state(reader.model, directory, layout, reader)
    loaded_s = time.perf_counter() - started
    losses = [actor.train_step(rows, check.args.micro_batch_size)["loss"] for actor in (writer, reader)]
    gap = largest_gap(local_weights(writer), local_weights(reader))
    if gap > weight_tolerance(check) or losses[0] != losses[1]:
        raise RuntimeError(
            f"the resumed policy's next step differs: loss {losses[1]:.6g} against {losses[0]:.6g}, weights "
            f"by up to {gap:.3g}"
        )
    size = sum(file.stat().st_size for file in directory.rglob("*") if file.is_file())
    return (
        f"saved {size / GIB:.2f} GiB in {saved_s:.1f} s, loaded in {loaded_s:.1f} s; the resumed policy's "
        f"next step has the same loss, weights within {gap:.2g}"
    )


STAGES: dict[str, Callable[[Check], str]] = {
    "environment": stage_environment,
    "bf16": stage_train,
    "log-probs": stage_logprobs,
    "fp8": stage_fp8,
    "param-gather": stage_param_gather,
    "checkpoint": stage_checkpoint,
    "engine": stage_engine,
}


def run_stages(check: Check, stages: dict[str, Callable[[Check], str]] = STAGES) -> dict[str, str]:
    """Each stage's status line (`ok: ...`, `skipped: ...`, `FAILED: ...`), printed as it finishes."""
    results = {}
    for name, stage in stages.items():
        label = "fp32" if name == "bf16" and not check.on_gpu else name
        started = time.perf_counter()
        try:
            detail = stage(check)
            status = f"ok ({time.perf_counter() - started:.0f} s): {detail}"
        except Skip as reason:
            status = f"skipped: {reason}"
        except Exception as error:  # a failed stage must not hide the ones after it
            status = f"FAILED: {type(error).__name__}: {error}"
            if check.layout.is_logging_rank:
                traceback.print_exc()
        results[name] = status
        if check.layout.is_logging_rank:
            print(f"gpu_check {label:>11}: {status}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    # Before CUDA starts: the allocator and NCCL read their settings once.
    cluster_env = cluster_environment(Path(args.slurm_env)) if args.slurm_env else {}
    os.environ.update(cluster_env)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False). Run it on a "
            "GPU node with a CUDA build of torch, e.g. inside the project's cluster image "
            "(slurm/Dockerfile), or pass --allow-cpu to run the stages on the CPU.",
            file=sys.stderr,
        )
        return 2
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.layout import initialize, shutdown

    if not any(override.startswith("model=") for override in overrides):
        overrides = [f"model={DEFAULT_MODEL}", *overrides]
    args.overrides = overrides
    world_size = process_env().world_size
    job = job_config.load(overrides, world_size=world_size)
    layout = initialize(job.parallel, job.seed)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_", dir=args.workdir) as scratch:
            # Every rank works in rank 0's directory: the engine stage's HF export is read by all of them.
            shared = [scratch]
            torch.distributed.broadcast_object_list(shared, src=0)
            check = Check(job=job, layout=layout, args=args, workdir=Path(shared[0]), cluster_env=cluster_env)
            if layout.is_logging_rank:
                print(
                    f"gpu_check: {job.model.name} ({flops.matmul_parameters(job.model) / 1e9:.2f}B matmul "
                    f"parameters), {layout.describe()}; {args.batch_size} x {args.seq_length} tokens per DP "
                    f"rank and step, micro-batch {args.micro_batch_size}",
                    flush=True,
                )
            chosen = args.stages.split(",") if args.stages else list(STAGES)
            results = run_stages(check, {name: STAGES[name] for name in chosen})
            torch.distributed.barrier()  # rank 0's directory outlives every rank's use of it
    finally:
        shutdown()
    return 1 if any(status.startswith("FAILED") for status in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
