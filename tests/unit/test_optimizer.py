"""The optimizer and LR schedule as built for training: warm-up counted in rollout steps, which parameters
decay, and what a resume takes from the checkpoint. Real megatron-core optimizers on one gloo rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dapo_megatron.config import ConfigError, compose, to_job_config
from dapo_megatron.trainer.config import OptimConfig
from dapo_megatron.trainer.optimizer import warmup_optimizer_steps
from tests.conftest import one_gloo_rank, tiny_policy

PAPER_RECIPES = ["dapo_qwen2.5_0.5b", "dapo_qwen2.5_7b", "dapo_qwen2.5_32b"]


@pytest.mark.parametrize("experiment", PAPER_RECIPES)
def test_paper_recipes_warm_up_over_20_rollout_steps_and_decay_every_parameter(experiment: str) -> None:
    job = to_job_config(compose([f"experiment={experiment}"]))
    per_rollout_step = job.trainer.train_batch_size // job.trainer.ppo_mini_batch_size
    assert warmup_optimizer_steps(job.optim, job.trainer.optimizer_steps) == 20 * per_rollout_step
    assert job.optim.weight_decay == 0.1 and job.optim.decay_all_parameters


def test_the_root_config_trains_with_the_papers_optimizer_and_the_demo_with_its_own() -> None:
    """A recipe that picks no optimizer (`model=qwen2.5-7b` alone) must not train at the tiny demo's rate."""
    root = to_job_config(compose(["model=qwen2.5-7b"])).optim
    assert (root.lr, root.weight_decay, root.lr_warmup_rollout_steps) == (1e-6, 0.1, 20)
    demo = to_job_config(compose(["experiment=demo"])).optim
    assert (demo.lr, demo.weight_decay, demo.lr_warmup_rollout_steps) == (3e-4, 0.0, 0)


def test_the_old_warmup_field_names_the_new_one() -> None:
    with pytest.raises(ConfigError, match=r"set optim\.lr_warmup_rollout_steps"):
        to_job_config(compose(["optim.lr_warmup_steps=20"]))


def test_a_warmup_needs_the_optimizer_steps_per_rollout_step() -> None:
    assert warmup_optimizer_steps(OptimConfig(), None) == 0
    with pytest.raises(ValueError, match=r"trainer\.optimizer_steps"):
        warmup_optimizer_steps(OptimConfig(lr_warmup_rollout_steps=3), None)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A factory of (model, optimizer, schedule) for a tiny Qwen2 policy, the same initial weights every
    time."""
    pytest.importorskip("megatron.core")
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.trainer.optimizer import build_optimizer

    with one_gloo_rank(tmp_path_factory.mktemp("gloo") / "store") as layout:
        torch.manual_seed(0)
        initial: dict[str, torch.Tensor] = {}

        def make(optim: OptimConfig, per_rollout_step: int | None = None) -> tuple[Any, Any, Any]:
            model, cfg = tiny_policy(layout, vocab_size=64)
            if initial:
                model.load_state_dict(initial)
            else:
                initial.update({k: v.clone() for k, v in model.state_dict().items() if v is not None})
            return (model, *build_optimizer(model, optim, ParallelConfig(), cfg, per_rollout_step))

        yield make


def test_warmup_is_linear_over_the_rollout_steps_in_optimizer_steps(build: Any) -> None:
    _, optimizer, scheduler = build(OptimConfig(lr=1e-3, lr_warmup_rollout_steps=2), 4)
    lrs = []
    for _ in range(10):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-3 * k / 8 for k in range(1, 9)] + [1e-3, 1e-3])


def test_resume_keeps_the_step_and_takes_the_schedule_from_the_config(build: Any) -> None:
    _, _, written = build(OptimConfig(lr=1e-3, lr_warmup_rollout_steps=1), 2)
    for _ in range(3):
        written.step(1)
    _, optimizer, resumed = build(OptimConfig(lr=2e-3, lr_warmup_rollout_steps=5), 2)
    resumed.load_state_dict(written.state_dict())
    assert resumed.num_steps == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 3 / 10)


@pytest.mark.parametrize("decay_all", [True, False])
def test_which_parameters_decay(build: Any, decay_all: bool) -> None:
    """With zero gradients Adam's update is 0, so one step moves a parameter by -lr * its weight decay *
    itself."""
    lr, decay = 1e-2, 0.1
    model, optimizer, scheduler = build(
        OptimConfig(lr=lr, weight_decay=decay, decay_all_parameters=decay_all)
    )
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    exempt = {name for name in before if "layernorm" in name or name.endswith(".bias")}
    assert len(exempt) == 7  # 2 layers x (2 norms + qkv bias), and the final norm
    model.zero_grad_buffer()
    optimizer.zero_grad()
    scheduler.step(1)
    update_ok, _, _ = optimizer.step()
    assert update_ok
    for name, param in model.named_parameters():
        shrink = 1.0 if name in exempt and not decay_all else 1.0 - lr * decay
        torch.testing.assert_close(param.detach(), before[name] * shrink, rtol=1e-6, atol=0, msg=name)


def test_resume_across_a_decay_rule_change_names_the_field(build: Any) -> None:
    from dapo_megatron.trainer.optimizer import load_optimizer_state

    _, written, _ = build(OptimConfig(lr=1e-3))
    _, same, _ = build(OptimConfig(lr=1e-3))
    load_optimizer_state(same, written.state_dict())
    _, other, _ = build(OptimConfig(lr=1e-3, decay_all_parameters=True))
    with pytest.raises(ValueError, match=r"resume with optim\.decay_all_parameters=false"):
        load_optimizer_state(other, written.state_dict())
    with pytest.raises(ValueError, match=r"resume with optim\.decay_all_parameters=true"):
        load_optimizer_state(same, other.state_dict())


def test_resume_across_a_distributed_optimizer_change_names_the_field(build: Any) -> None:
    from dapo_megatron.trainer.optimizer import check_optimizer_kind

    _, optimizer, _ = build(OptimConfig(lr=1e-3))
    check_optimizer_kind(optimizer, optimizer.state_dict())
    # The distributed optimizer's non-tensor state, as its sharded_state_dict leaves it in a checkpoint.
    saved = {"optimizer": {"param_groups": []}, "param_state_sharding_type": "fully_reshardable"}
    with pytest.raises(ValueError, match=r"resume with parallel\.use_distributed_optimizer=true"):
        check_optimizer_kind(optimizer, saved)
