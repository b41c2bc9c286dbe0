"""The ablation ladder without training: its configs, bench/ablation.py's report on synthetic metrics, and
tools/plot_metrics.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from dapo_megatron import config as job_config
from dapo_megatron.algo.reward_shaping import overlong_penalty
from dapo_megatron.data import arithmetic, char_tokenizer
from tests.conftest import REPO, load_bench_script, load_script

ablation = load_bench_script("ablation")
plot_metrics = load_script(REPO / "tools" / "plot_metrics.py")

# What each rung adds to the one before it, as the paper's Table 1 lists them.
LADDER = {
    "1_overlong_filter": {"algo.overlong_filter": True},
    "2_clip_higher": {"algo.clip_ratio_high": 0.28},
    "3_soft_overlong": {"algo.overlong_buffer_enable": True, "algo.overlong_buffer_length": 5},
    "4_token_level_loss": {"algo.loss_agg_mode": "token-mean"},
    "5_dapo": {"trainer.dynamic_sampling": True},
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, child in node.items() for k, v in flat(child, f"{prefix}{key}.").items()}


@pytest.fixture(scope="module")
def rungs() -> dict[str, dict[str, Any]]:
    composed = {rung: job_config.compose([f"experiment=ablation/{rung}"]) for rung in ablation.RUNGS}
    for cfg in composed.values():
        job_config.to_job_config(cfg)  # validates
    return {rung: flat(OmegaConf.to_container(cfg)) for rung, cfg in composed.items()}


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    return flat(OmegaConf.to_container(job_config.compose(["experiment=demo"])))


def test_every_rung_adds_exactly_its_change(rungs: dict[str, dict[str, Any]]) -> None:
    assert list(rungs) == ["0_naive_grpo", *LADDER]
    for previous, rung in zip(rungs, list(rungs)[1:], strict=False):
        before, after = rungs[previous], rungs[rung]
        changed = {k: after[k] for k in after if k != "experiment_name" and before.get(k) != after[k]}
        assert changed == LADDER[rung], rung


def algo_file(name: str) -> dict[str, Any]:
    """The fields configs/algo/<name>.yaml sets itself (and through its defaults)."""
    fields: dict[str, Any] = {}
    for key, value in OmegaConf.to_container(
        OmegaConf.load(REPO / "configs" / "algo" / f"{name}.yaml")
    ).items():
        if key == "defaults":
            for parent in value:
                if parent != "_self_":
                    fields.update(algo_file(parent))
        else:
            fields[f"algo.{key}"] = value
    return fields


def test_the_ends_of_the_ladder_are_the_papers_grpo_and_dapo(
    rungs: dict[str, dict[str, Any]], demo: dict[str, Any]
) -> None:
    first, last = rungs["0_naive_grpo"], rungs["5_dapo"]
    grpo = algo_file("grpo")
    assert {k: first[k] for k in grpo} == grpo
    assert not first["trainer.dynamic_sampling"]
    # DAPO's loss and shaping with the buffer fitted to the task; overlong filtering stays on, as the
    # ladder is cumulative.
    dapo = algo_file("dapo")
    dapo.update({"algo.overlong_buffer_length": 5, "algo.overlong_filter": True})
    assert {k: last[k] for k in dapo} == dapo
    assert last["trainer.dynamic_sampling"]
    # Every rung trains the demo's model on the ladder's task, from the base bench/ablation.py builds for it.
    for rung in rungs.values():
        assert rung["data.task"] == ablation.TASK != demo["data.task"]
        assert REPO / rung["model.hf_dir"] == ablation.BASE
        assert rung["model.name"] == demo["model.name"]


def test_soft_punishment_starts_just_above_the_longest_correct_answer(
    rungs: dict[str, dict[str, Any]],
) -> None:
    """The buffer covers only rambling: no correct response (its working, answer and end-of-text) is
    penalised, one token more is, and correct responses vary in length enough that per-sequence and
    per-token averaging weight them differently."""
    rung = rungs["3_soft_overlong"]
    cap, buffer = rung["rollout.max_response_length"], rung["algo.overlong_buffer_length"]
    lengths = {
        len(char_tokenizer.encode(p.target)) + 1
        for split in ("rl", "eval")
        for p in arithmetic.problems(split, task=rung["data.task"])
    }
    assert (min(lengths), max(lengths)) == (14, 31)  # "3 8\nAnswer: 8" .. seven running sums
    assert all(overlong_penalty(n, max_response_length=cap, buffer_length=buffer) == 0 for n in lengths)
    assert overlong_penalty(max(lengths) + 1, max_response_length=cap, buffer_length=buffer) < 0
    assert overlong_penalty(cap, max_response_length=cap, buffer_length=buffer) == -1.0


def records(evals: dict[int, float], *, seconds_per_step: float = 10.0) -> list[dict[str, Any]]:
    """A run of four steps (2 kept groups, 1.5 samples generated per kept one) with evaluations at `evals`."""
    out: list[dict[str, Any]] = []
    for step in range(5):
        if step:
            out.append(
                {
                    "step": step,
                    "dynamic_sampling/kept_groups": 2.0,
                    "dynamic_sampling/samples_per_kept": 1.5,
                    "actor/entropy": 0.1 * step,
                    "response_length/mean": 10.0 + step,
                    "response_length/clip_ratio": 0.05 if step == 3 else 0.0,
                    ablation.SECONDS: seconds_per_step * step,
                }
            )
        if step in evals:
            out.append(
                {
                    "step": step,
                    plot_metrics.EVAL_ACCURACY: evals[step],
                    ablation.SECONDS: seconds_per_step * step + 1,
                }
            )
    return out


def test_run_summary() -> None:
    run = records({0: 0.2, 2: 0.5, 4: 0.45})
    summary = ablation.summarise_run(run, ablation.Names(), target=0.4, group_size=4, tail=2)
    assert summary == {
        "final": 0.45,
        "best": 0.5,
        "seconds_to_target": 21.0,  # the step-2 evaluation
        "samples_to_target": 2 * (2 * 1.5 * 4),  # steps 1 and 2
        "entropy": pytest.approx(0.35),  # steps 3 and 4
        "response_length": 13.5,
        "cut_at_cap": pytest.approx(0.0125),  # one step of four cut 5%
        "cut_at_cap_max": 0.05,
        "seconds": 41.0,
    }
    never = ablation.summarise_run(
        records({0: 0.2, 4: 0.3}), ablation.Names(), target=0.4, group_size=4, tail=2
    )
    assert never["seconds_to_target"] is None and never["samples_to_target"] is None
    with pytest.raises(ValueError, match="val/acc"):
        ablation.summarise_run(run, ablation.Names(accuracy="val/acc"), target=0.4, group_size=4, tail=2)


def test_report_writes_the_table_and_the_plots(tmp_path: Path) -> None:
    runs = {
        "0_naive_grpo": [records({0: 0.2, 4: 0.3}), records({0: 0.2, 4: 0.5})],
        "5_dapo": [records({0: 0.2, 2: 0.6, 4: 0.7}, seconds_per_step=20.0)],
    }
    text = ablation.report(runs, tmp_path, ablation.Names(), target=0.4, group_size=4, tail=2)
    assert text == (tmp_path / "table.md").read_text()
    rows = text.splitlines()
    assert len(rows) == 4
    assert rows[2].startswith("| naive GRPO | 2 | 0.400 ± 0.141 | 0.400 ± 0.141 | 1/2 | 41 | 48 |")
    assert rows[2].endswith("| 1.25, 5.0 | 41 |")
    assert rows[3].startswith(
        "| + dynamic sampling (DAPO) | 1 | 0.700 ± 0.000 | 0.700 ± 0.000 | 1/1 | 41 | 24 |"
    )
    for name in ("heldout_accuracy", "entropy", "response_length"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_band_is_mean_and_range_over_steps_every_run_reached() -> None:
    a = [{"step": 1, "m": 1.0}, {"step": 2, "m": 3.0}, {"step": 3, "m": 5.0}]
    b = [{"step": 1, "m": 2.0}, {"step": 2, "m": float("nan")}, {"step": 2, "m": 4.0}]
    assert plot_metrics.band([a, b], "m") == ([1.0, 2.0], [1.5, 3.5], [1.0, 3.0], [2.0, 4.0])


def test_plot_metrics_cli(tmp_path: Path) -> None:
    for name, accuracy in (("a", 0.3), ("b", 0.6)):
        run = tmp_path / name / "tensorboard"
        run.mkdir(parents=True)
        lines = [json.dumps({"step": s, "eval/accuracy": accuracy + 0.1 * s}) for s in range(3)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "eval/acc')  # cut mid-write
    png = tmp_path / "curves.png"
    command = [sys.executable, str(REPO / "tools" / "plot_metrics.py"), f"{tmp_path / 'a'}=A"]
    done = subprocess.run(
        [*command, str(tmp_path / "b"), "--metric", "eval/accuracy", "--output", str(png)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == PNG_MAGIC
    wrong = subprocess.run(
        [*command, "--metric", "val/acc", "--output", str(png)], capture_output=True, text=True
    )
    assert wrong.returncode == 2
    assert "no run logs ['val/acc']" in wrong.stderr and "eval/accuracy" in wrong.stderr
