"""Supervised warm-up of the demo's from-scratch policy on a synthetic arithmetic task (`data.task`).

    python -m dapo_megatron.trainer.warmup [hydra overrides]      (or under torchrun / srun)

Trains with cross-entropy on the target tokens (working and answer) until held-out accuracy reaches
`warmup.target_accuracy`, then writes a torch_dist checkpoint and a Hugging Face directory (the
starting policy for RL and the rollout engine). Real megatron-core under any TP x PP x DP layout.
With `model.hf_dir` it continues an earlier warm-up from its Hugging Face export (same task and split;
the optimizer starts afresh) instead of from random weights: a base that stopped short of its target
need not be rebuilt from scratch (the ~30M benchmark base takes hours on two cores).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dapo_megatron import checkpoint
from dapo_megatron import config as job_config
from dapo_megatron.config import JobConfig
from dapo_megatron.data import arithmetic, char_tokenizer
from dapo_megatron.distributed.launch import process_env
from dapo_megatron.distributed.layout import ParallelLayout, initialize, shutdown
from dapo_megatron.metrics import MetricsLogger, configure_console, console, format_line
from dapo_megatron.models.qwen2 import build_gpt_model
from dapo_megatron.models.weights import export_hf, load_hf_weights
from dapo_megatron.rewards.math_dapo import compute_score
from dapo_megatron.trainer.forward import MicroBatch, greedy_generate, run_schedule, vocab_parallel_argmax
from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training


def supervised_batch(problems: list[arithmetic.Problem]) -> MicroBatch:
    """prompt + target + EOS per row, right-padded; the loss covers the target and EOS only."""
    return completion_batch([target_row(problem) for problem in problems])


def target_row(problem: arithmetic.Problem) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids + EOS): what the warm-up trains on and what teacher forcing checks."""
    return char_tokenizer.encode(problem.prompt), [
        *char_tokenizer.encode(problem.target),
        char_tokenizer.EOS_ID,
    ]


def completion_batch(rows: list[tuple[list[int], list[int]]]) -> MicroBatch:
    """(prompt ids, completion ids) rows as one right-padded micro-batch whose loss mask covers the
    completions.

    tokens, labels, loss_mask: [batch, seq] where labels[t] = the token after tokens[t].
    """
    width = max(len(prompt) + len(completion) for prompt, completion in rows) - 1
    tokens = torch.full((len(rows), width), char_tokenizer.PAD_ID)
    labels = torch.full((len(rows), width), char_tokenizer.PAD_ID)
    loss_mask = torch.zeros(len(rows), width)
    for row, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        n = len(ids) - 1
        tokens[row, :n] = torch.tensor(ids[:-1])
        labels[row, :n] = torch.tensor(ids[1:])
        loss_mask[row, len(prompt) - 1 : n] = 1.0
    return MicroBatch(tokens=tokens, labels=labels, loss_mask=loss_mask)


def token_sum(
    mb: MicroBatch, per_token_loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Cross-entropy summed over answer tokens, with the token count (see `forward.LossFn`)."""
    total = (per_token_loss.float() * mb.loss_mask).sum()
    count = mb.loss_mask.sum().to(torch.int)
    return total, count, {"loss_sum": total.detach().clone(), "tokens": count.clone()}


def greedy_accuracy(
    model: torch.nn.Module,
    problems: list[arithmetic.Problem],
    layout: ParallelLayout,
    *,
    vocab_size: int,
    max_new_tokens: int,
) -> float:
    completions = greedy_generate(
        model,
        [char_tokenizer.encode(p.prompt) for p in problems],
        layout,
        max_new_tokens=max_new_tokens,
        eos_token_id=char_tokenizer.EOS_ID,
        pad_token_id=char_tokenizer.PAD_ID,
        vocab_size=vocab_size,
    )
    correct = [
        compute_score(char_tokenizer.decode(c), p.answer)["acc"]
        for c, p in zip(completions, problems, strict=True)
    ]
    return sum(correct) / len(correct)


@torch.no_grad()
def teacher_forced_exact(
    model: torch.nn.Module,
    rows: list[tuple[list[int], list[int]]],
    layout: ParallelLayout,
    *,
    vocab_size: int,
    micro_batch_size: int,
) -> list[bool]:
    """Per (prompt, completion) row: is every completion token the argmax given the prompt and the completion
    before it? Exactly when greedy decoding writes that completion (ending in EOS, it then stops), in one
    forward pass instead of one per token (`warmup.eval_mode=teacher_forced`). The same on every rank."""

    def exact_rows(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        predicted = vocab_parallel_argmax(logits, layout, vocab_size)
        assert mb.labels is not None and mb.loss_mask is not None
        exact = ((predicted == mb.labels) | (mb.loss_mask == 0)).all(dim=1)
        return logits.sum(), torch.ones((), dtype=torch.int), {"exact": exact}

    micro = [completion_batch(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    reports = run_schedule(model, micro, exact_rows, forward_only=True, with_labels=False)
    # Reports exist on the last pipeline stage only.
    exact = (
        torch.cat([r["exact"] for r in reports])
        if layout.is_last_stage
        else torch.empty(len(rows), dtype=torch.bool)
    )
    if layout.pp_size > 1:
        torch.distributed.broadcast(exact, src=layout.pp_last_rank, group=layout.pp_group)
    return exact.tolist()


def earlier_warmup(job: JobConfig) -> dict[str, Any]:
    """The summary of the warm-up that `model.hf_dir` comes from ({} without one); refuses one on another task
    or split, whose training problems would include this split's held-out ones."""
    if not job.model.hf_dir:
        return {}
    summary_file = Path(job.model.hf_dir) / "warmup_summary.json"
    if not summary_file.exists():
        raise ValueError(
            f"model.hf_dir={job.model.hf_dir} has no warmup_summary.json: continue only a warm-up's "
            "own export (tools/make_demo_base.py), or unset model.hf_dir to start from random weights"
        )
    summary = json.loads(summary_file.read_text())
    built = arithmetic.warmed_up_on(summary)
    wanted = (job.data.task, job.data.split_seed(job.seed))
    if built != wanted:
        raise ValueError(
            f"model.hf_dir={job.model.hf_dir} was warmed up on data.task={built[0]} split with seed "
            f"{built[1]}, this warm-up is data.task={wanted[0]} split with seed {wanted[1]}: pass "
            f"data.task={built[0]} data.task_seed={built[1]} to continue it"
        )
    return summary


def run(
    job: JobConfig,
    layout: ParallelLayout,
    model: torch.nn.Module,
    metrics: MetricsLogger,
    earlier_steps: int = 0,
) -> tuple[float, int]:
    """Train `model` (a DDP-wrapped chunk) until the target accuracy; returns the last measured accuracy
    and the number of steps taken. `earlier_steps`: of the warm-up this one continues."""
    cfg = job.warmup
    optim = dataclasses.replace(job.optim, lr=cfg.lr, lr_warmup_rollout_steps=0, weight_decay=0.0)
    optimizer, scheduler = build_optimizer(model, optim, job.parallel, job.model)
    split_seed = job.data.split_seed(job.seed)
    train_set = arithmetic.problems("warmup", seed=split_seed, task=job.data.task)
    eval_set = arithmetic.problems("eval", seed=split_seed, task=job.data.task)[: cfg.eval_size]
    vocab_size = len(char_tokenizer.VOCAB)

    def teacher_forced() -> float:
        exact = teacher_forced_exact(
            model,
            [target_row(p) for p in eval_set],
            layout,
            vocab_size=vocab_size,
            micro_batch_size=cfg.micro_batch_size,
        )
        return sum(exact) / len(exact)

    def greedy() -> float:
        longest = max(len(completion) for _, completion in map(target_row, eval_set))
        return greedy_accuracy(
            model, eval_set, layout, vocab_size=vocab_size, max_new_tokens=cfg.max_new_tokens or longest
        )

    measure = teacher_forced if cfg.eval_mode == "teacher_forced" else greedy
    # Same order on every rank; each data-parallel rank then trains on its own slice of the batch. A continued
    # warm-up draws other batches than the one it continues drew first.
    rng = random.Random(job.seed + earlier_steps)
    per_rank = cfg.batch_size // layout.dp_size
    accuracy = 0.0
    for step in range(1, cfg.max_steps + 1):
        started = time.perf_counter()
        batch = rng.sample(train_set, cfg.batch_size)[
            layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank
        ]
        micro = [
            supervised_batch(batch[i : i + cfg.micro_batch_size])
            for i in range(0, per_rank, cfg.micro_batch_size)
        ]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = run_schedule(model, micro, token_sum, forward_only=False, with_labels=True)
        scheduler.step(1)
        _, grad_norm, _ = optimizer.step()
        loss = _global_token_mean(reports)
        fields = {"loss": loss, "grad_norm": float(grad_norm or 0.0), "s/step": time.perf_counter() - started}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            accuracy = measure()
            fields["eval_acc"] = accuracy
        metrics.log({f"warmup/{k.replace('s/step', 'step_time_s')}": v for k, v in fields.items()}, step)
        if step % 10 == 0 or "eval_acc" in fields:
            console.info(format_line(f"warmup step {step:4d}/{cfg.max_steps}", fields))
        if accuracy >= cfg.target_accuracy:
            break
    return accuracy, step


def _global_token_mean(reports: list[dict[str, Any]]) -> float:
    """The batch's loss as trained: every answer token of every data-parallel replica weighs the same.
    Collective; reports exist on last pipeline stages only, other ranks contribute zeros."""
    totals = torch.zeros(2, dtype=torch.float64)
    for report in reports:
        totals += torch.stack([report["loss_sum"].double(), report["tokens"].double()])
    torch.distributed.all_reduce(totals)
    # Each replica's loss appears once per TP rank of its last stage; the ratio is unaffected.
    return float(totals[0] / totals[1])


def main(argv: list[str] | None = None) -> int:
    job = job_config.load(sys.argv[1:] if argv is None else argv, world_size=process_env().world_size)
    earlier = earlier_warmup(job)
    layout = initialize(job.parallel, job.seed)
    configure_console(logging_rank=layout.is_logging_rank, level=job.trainer.log_level)
    out = Path(job.output_dir)
    try:
        with MetricsLogger(out / "tensorboard", enabled=layout.is_logging_rank) as metrics:
            console.info(
                f"warm-up: {job.model.name} ({job.model.num_parameters():,} parameters), {layout.describe()}"
            )
            model = wrap_for_training(build_gpt_model(job.model, job.parallel, layout), job.parallel)
            if earlier:
                load_hf_weights(model, job.model.hf_dir, job.model, layout)
                console.info(
                    f"continuing the warm-up of {job.model.hf_dir} after its {earlier['steps']} steps"
                )
            started = time.time()
            accuracy, steps = run(job, layout, model, metrics, earlier_steps=earlier.get("steps", 0))
            saved = checkpoint.save_model(model, out / "warmup", step=0, model_cfg=job.model, layout=layout)
            tokenizer_dir = out / "tokenizer"
            if layout.is_logging_rank:
                char_tokenizer.save(tokenizer_dir)
            torch.distributed.barrier()
            hf_dir = export_hf(model, job.model, layout, out / "warmup_hf", tokenizer_dir=tokenizer_dir)
            if hf_dir is not None:
                summary = {
                    f"{job.warmup.eval_mode}_eval_accuracy": accuracy,
                    "steps": steps,
                    "seed": job.seed,
                    "task": job.data.task,
                    "task_seed": job.data.split_seed(job.seed),
                    "warmup": dataclasses.asdict(job.warmup),
                    "model": dataclasses.asdict(job.model),
                }
                if earlier:  # `steps` counts the whole warm-up; the one continued is kept as it was
                    summary.update(
                        steps=earlier["steps"] + steps,
                        continued={k: earlier[k] for k in earlier if k != "model"},
                    )
                (hf_dir / "warmup_summary.json").write_text(json.dumps(summary, indent=2))
            console.info(
                f"warm-up done in {time.time() - started:.0f}s: held-out {job.warmup.eval_mode} accuracy "
                f"{accuracy:.2f}; checkpoint {saved}, Hugging Face export {hf_dir}"
            )
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
