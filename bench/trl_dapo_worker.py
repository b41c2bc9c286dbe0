#!/usr/bin/env python
"""The peer side of bench_e2e_trl.py: Hugging Face TRL's GRPOTrainer configured as DAPO on a synthetic task.

Runs only in the separate benchmark environment (requirements-bench.txt); nothing in dapo_megatron imports
TRL. From this project it reuses only dependency-free pieces, so both trainers see the same task and reward:
the arithmetic problems of the same task and split (`data.arithmetic`, --task), DAPO's group filter
(`algo.dynamic_sampling.judge_group`, to count informative samples), the tokenizer loader (`data.tokenizer`,
which keeps the character tokenizer's ids) and DAPO's scorer (`rewards.math_dapo`).

Writes one JSON line per rollout step to --out: wall time (`time.time()`, after that step's evaluation if one
was due), cumulative evaluation seconds (that evaluation included),
cumulative generated samples, response tokens and informative samples (those of groups whose samples disagree,
so that their advantages are not all zero: what DAPO's dynamic sampling keeps), and the held-out greedy
accuracy when evaluated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dapo_megatron.algo.dynamic_sampling import KEEP_REASONS, judge_group  # noqa: E402
from dapo_megatron.data import arithmetic  # noqa: E402
from dapo_megatron.data.tokenizer import load_tokenizer  # noqa: E402
from dapo_megatron.rewards.math_dapo import compute_score  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--task", choices=arithmetic.TASKS, required=True, help="as the trainer's data.task")
    parser.add_argument(
        "--task-seed",
        type=int,
        required=True,
        help="the seed that split the base's task (as the trainer's data.task_seed)",
    )
    parser.add_argument("--steps", type=int, required=True, help="rollout steps")
    parser.add_argument("--prompts", type=int, required=True, help="prompts per rollout step")
    parser.add_argument("--group", type=int, required=True, help="samples per prompt")
    parser.add_argument("--mini-batch", type=int, required=True, help="prompts per optimizer step")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--overlong-buffer", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    parser.add_argument("--eval-problems", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Counter:
    """What the reward function sees is exactly what was generated: count it there."""

    def __init__(self) -> None:
        self.samples = 0
        self.tokens = 0
        self.informative = 0


def dapo_reward(counter: Counter, tokenizer: Any, group: int) -> Any:
    def reward(
        completions: list[str], answer: list[str], completion_ids: list[list[int]] | None = None, **_: Any
    ) -> list[float]:
        ids = completion_ids if completion_ids is not None else [tokenizer.encode(c) for c in completions]
        counter.samples += len(completions)
        counter.tokens += sum(len(i) for i in ids)
        scores = [compute_score(c, a) for c, a in zip(completions, answer, strict=True)]
        # TRL repeats each prompt `group` times in a row, so a generation batch is whole groups, in order.
        for start in range(0, len(scores), group):
            accuracies = [bool(s["acc"]) for s in scores[start : start + group]]
            counter.informative += len(accuracies) if judge_group(accuracies) in KEEP_REASONS else 0
        return [float(s["score"]) for s in scores]

    reward.__name__ = "math_dapo"  # TRL names its logged reward columns after the function
    return reward


def greedy_accuracy(
    model: Any, tokenizer: Any, problems: list[arithmetic.Problem], max_new_tokens: int
) -> float:
    import torch

    was_training = model.training
    model.eval()
    correct = 0
    tokenizer.padding_side = "left"
    with torch.no_grad():
        for start in range(0, len(problems), 100):
            chunk = problems[start : start + 100]
            batch = tokenizer(
                [p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False
            )
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(compute_score(t, p.answer)["acc"] for t, p in zip(texts, chunk, strict=True))
    model.train(was_training)
    return correct / len(problems)


def main() -> None:
    args = parse_args()
    import torch
    from datasets import Dataset
    from transformers import Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.base)
    model = Qwen2ForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    train = Dataset.from_list(
        [
            {"prompt": p.prompt, "answer": p.answer}
            for p in arithmetic.problems("rl", seed=args.task_seed, task=args.task)
        ]
    )
    held_out = arithmetic.problems("eval", seed=args.task_seed, task=args.task)[: args.eval_problems]
    optimizer_steps = args.prompts // args.mini_batch
    counter = Counter()
    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl_out"),
        use_cpu=True,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=optimizer_steps,
        disable_dropout=True,
        # One rollout batch of prompts x group samples feeds `optimizer_steps` optimizer steps of one
        # mini-batch each, a single pass (num_iterations=1): the later steps are off-policy, so clipping acts.
        num_generations=args.group,
        per_device_train_batch_size=args.mini_batch * args.group,
        gradient_accumulation_steps=1,
        steps_per_generation=optimizer_steps,
        num_iterations=1,
        max_steps=args.steps * optimizer_steps,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # DAPO: token-level loss over the batch, clip-higher 0.2 / 0.28, no KL, group-normalised advantages.
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        scale_rewards="group",
        # The optimiser of configs/optim/adamw_demo.yaml.
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        # GRPOConfig turns bf16 autocast on unless told otherwise, on CPU too; this project trains in fp32,
        # and the comparison must be of the same numerics.
        bf16=False,
        # GRPOConfig turns gradient checkpointing on by default: every update would recompute its forward
        # pass, which memory does not call for at these sizes. TRL at its fastest runs without it.
        gradient_checkpointing=False,
    )
    out = args.out.open("w")

    def record(step: int, eval_s: float, accuracy: float | None) -> None:
        out.write(
            json.dumps(
                {
                    "step": step,
                    "time": time.time(),
                    "eval_s": eval_s,
                    "samples": counter.samples,
                    "tokens": counter.tokens,
                    "informative": counter.informative,
                    "eval_accuracy": accuracy,
                }
            )
            + "\n"
        )
        out.flush()

    class Progress(TrainerCallback):
        """At every rollout-step boundary: a time stamp, and the held-out accuracy when due."""

        eval_s = 0.0

        def evaluate(self, step: int) -> None:
            now = time.time()
            due = step % args.eval_every == 0 or step == args.steps
            accuracy = greedy_accuracy(model, tokenizer, held_out, args.max_new_tokens) if due else None
            self.eval_s += time.time() - now
            record(step, self.eval_s, accuracy)
            if accuracy is not None:
                print(f"trl step {step}/{args.steps} | eval_acc {accuracy:.3f}", flush=True)

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.evaluate(0)

        def on_step_end(self, _args: Any, state: Any, *a: Any, **k: Any) -> None:
            if state.global_step % optimizer_steps == 0:
                self.evaluate(state.global_step // optimizer_steps)

    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=train,
        args=config,
        reward_funcs=[
            dapo_reward(counter, tokenizer, args.group),
            get_soft_overlong_punishment(args.max_new_tokens, args.overlong_buffer),
        ],
        callbacks=[Progress()],
    )
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
