"""bench/bench_e2e_trl.py's bookkeeping over repeated runs, on hand-made run results (the runs themselves are
the benchmark: far too slow for a test)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dapo_megatron import config as C
from tests.conftest import REPO, load_bench_script

bench = load_bench_script("bench_e2e_trl")
SIZE = bench.replace(bench.SIZES["large"], target_acc=0.3, target_gain=None)


def run(seconds_per_step: float, accuracies: list[float]) -> dict[str, Any]:
    """A run of 5-step evaluations whose step takes `seconds_per_step`, accuracies at steps 0, 5, 10, ..."""
    steps = [
        {"seconds": seconds_per_step, "trained": 64, "generated": 64, "tokens": 6400, "informative": 64}
        for _ in range(5 * (len(accuracies) - 1))
    ]
    evals = [(5 * i, acc, 10.0 + 5 * i * seconds_per_step) for i, acc in enumerate(accuracies)]
    return bench.summarise(steps, evals, startup=10.0, size=SIZE)


def test_time_to_accuracy_is_the_upper_median_with_misses_counted_as_later() -> None:
    fast, slow, miss = run(10.0, [0.2, 0.3]), run(10.0, [0.2, 0.25, 0.31]), run(10.0, [0.2, 0.25, 0.29])
    assert (fast["time_to_accuracy_s"], slow["time_to_accuracy_s"], miss["time_to_accuracy_s"]) == (
        60.0,
        110.0,
        None,
    )
    # Two of three reached it: the median run is the slower of those two, and its accuracies come along.
    three = bench.over_runs([miss, fast, slow])
    assert three["time_to_accuracy_s"] == 110.0 and three["reached_at_step"] == 10
    assert three["eval_accuracy"] == slow["eval_accuracy"]
    assert three["reached_runs"] == 2 / 3
    # Of two, the slower: one miss makes the pair's time None, however fast the other was.
    two = bench.over_runs([fast, miss])
    assert two["time_to_accuracy_s"] is None and two["reached_runs"] == 0.5
    one = bench.over_runs([fast])
    assert one["time_to_accuracy_s"] == 60.0 and one["reached_runs"] == 1.0


def test_trls_evaluation_time_is_left_out_of_its_time_to_accuracy() -> None:
    """The worker stamps a step after its evaluation; the evaluated weights existed before it ran."""
    launched = 1000.0
    lines = [  # 4 s of training per step; the evaluations at steps 0 and 2 take 10 s and 30 s
        {"step": 0, "time": 1010.0, "eval_s": 10.0, "samples": 0, "tokens": 0, "informative": 0,
         "eval_accuracy": 0.2},
        {"step": 1, "time": 1014.0, "eval_s": 10.0, "samples": 64, "tokens": 640, "informative": 32,
         "eval_accuracy": None},
        {"step": 2, "time": 1048.0, "eval_s": 40.0, "samples": 128, "tokens": 1280, "informative": 64,
         "eval_accuracy": 0.3},
    ]  # fmt: skip
    steps, evals = bench.trl_progress(lines, launched)
    assert [step["seconds"] for step in steps] == [4.0, 4.0]
    assert evals == [(0, 0.2, 0.0), (2, 0.3, 8.0)]


def test_rates_pool_every_runs_steps() -> None:
    quick, slow = run(10.0, [0.2, 0.3]), run(30.0, [0.2, 0.3, 0.3])  # 5 steps of 10 s, 10 steps of 30 s
    pooled = bench.over_runs([quick, slow])
    assert pooled["step_seconds"]["n"] == 15 and pooled["step_seconds"]["median"] == 30.0
    assert pooled["runs"] == [quick, slow]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--repeats=0", "--repeats must be at least 1"),
        ("--pairs=-1", "--pairs must be at least 0"),
        ("--resume", "--resume reads the finished runs of an earlier call from --keep DIR"),
    ],
)
def test_bad_counts_are_refused_before_anything_runs(flag: str, message: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_e2e_trl.py"), flag],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr


def test_throughput_pairs_run_both_sides_on_the_same_steps_and_ratio_each_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any, dict[str, Any]]] = []

    def trl(size: Any, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
        calls.append(("trl", size, {}))
        first = sum(side == "trl" for side, _, _ in calls) == 1
        return run(30.0 if first else 10.0, [0.2, 0.2])  # 30 s per step in the first pair, 10 s in the second

    def ours(size: Any, scratch: Path, args: argparse.Namespace, **how: Any) -> dict[str, Any]:
        calls.append(("ours", size, how))
        return run(20.0 if how.get("overlap") else 25.0, [0.2, 0.2])

    monkeypatch.setattr(bench, "trl", trl)
    monkeypatch.setattr(bench, "ours", ours)
    pairs = bench.throughput_pairs(SIZE, tmp_path, argparse.Namespace(pairs=2))
    assert [side for side, _, _ in calls] == ["trl", "ours", "ours", "trl", "ours", "ours"]
    # Both sides run the same-work step count; this project without dynamic sampling, generating ahead and
    # synchronously.
    assert all(size.trl_steps == size.same_work_steps == SIZE.same_work_steps for _, size, _ in calls)
    assert [how for side, _, how in calls if side == "ours"] == 2 * [
        {"dynamic_sampling": False, "overlap": True},
        {"dynamic_sampling": False},
    ]
    assert [pair["ratio"] for pair in pairs] == pytest.approx([30.0 / 20.0, 10.0 / 20.0])
    assert [pair["synchronous_ratio"] for pair in pairs] == pytest.approx([30.0 / 25.0, 10.0 / 25.0])
    assert all((tmp_path / f"pair{i}").is_dir() for i in range(2))


def test_every_sizes_engine_holds_its_requests_in_flight() -> None:
    """The ~30M size would otherwise inherit the demo's 16384-token cache, which holds ~100 of its 256
    requests in flight: the engine would queue and retract them and the benchmark would time that."""
    for size in bench.SIZES.values():
        kv = [] if size.kv_tokens is None else [f"rollout.max_total_tokens={size.kv_tokens}"]
        job = C.load(["experiment=demo", *kv, f"rollout.max_response_length={size.max_new_tokens}"])
        assert job.rollout.kv_shortfall() is None, size.name


def test_a_sides_start_up_is_the_median_over_its_runs() -> None:
    runs = [run(10.0, [0.2, 0.3]) | {"startup_seconds": s} for s in (10.0, 30.0, 20.0)]
    assert bench.over_runs(runs)["startup_seconds"] == 20.0


def test_a_relative_target_is_the_runs_own_start_plus_the_gain() -> None:
    """The large size's bar sits 0.08 above whatever its base scores, so a base that lands elsewhere is
    asked the same gain."""
    size = bench.SIZES["large"]
    assert size.target_gain == 0.08
    steps = [{"seconds": 10.0, "trained": 64, "generated": 64, "tokens": 6400, "informative": 64}] * 10
    evals = [(0, 0.215, 10.0), (5, 0.29, 60.0), (10, 0.295, 110.0)]
    result = bench.summarise(steps, evals, startup=10.0, size=size)
    assert result["target_accuracy"] == 0.295 and result["reached_at_step"] == 10
    weaker = bench.summarise(steps, [(0, 0.12, 10.0), (5, 0.2, 60.0), (10, 0.29, 110.0)], 10.0, size)
    assert weaker["target_accuracy"] == 0.2 and weaker["reached_at_step"] == 5


def test_a_finished_run_is_saved_and_read_back_on_resume_only_with_the_same_settings(tmp_path: Path) -> None:
    where, spec = tmp_path / "trl_large_seed0", ["python", "worker.py", "--steps=60"]
    result = run(10.0, [0.2, 0.3])
    first = bench.run_once(where, spec, argparse.Namespace(resume=False), lambda: result)
    assert first == result and [f.name for f in tmp_path.iterdir()] == ["trl_large_seed0.result.json"]

    def must_not_run() -> dict[str, Any]:
        raise AssertionError("a finished run ran again")

    again = bench.run_once(where, spec, argparse.Namespace(resume=True), must_not_run)
    assert again["time_to_accuracy_s"] == result["time_to_accuracy_s"] == 60.0
    assert again["eval_accuracy"] == [[0, 0.2], [5, 0.3]]  # JSON's lists for the tuples
    with pytest.raises(SystemExit, match=r"trl_large_seed0\.result\.json was run with other settings"):
        bench.run_once(where, [*spec[:-1], "--steps=20"], argparse.Namespace(resume=True), must_not_run)
    # Without --resume a saved result is run again and replaced.
    rerun = bench.run_once(where, spec, argparse.Namespace(resume=False), lambda: run(20.0, [0.2, 0.3]))
    assert bench.run_once(where, spec, argparse.Namespace(resume=True), must_not_run) == bench.json.loads(
        bench.json.dumps(rerun)
    )


def test_each_seeds_two_sides_run_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed by seed, so that a seed's TRL and this project's runs are minutes apart, not hours."""
    calls: list[str] = []

    def trl(size: Any, scratch: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
        calls.append(f"trl{seed}")
        return run(30.0, [0.2, 0.3])

    def ours(size: Any, scratch: Path, args: argparse.Namespace, **how: Any) -> dict[str, Any]:
        calls.append("ours" + (f"{how['seed']}.{how['run']}" if "seed" in how else "_same_work"))
        return run(10.0, [0.2, 0.3])

    monkeypatch.setattr(bench, "trl", trl)
    monkeypatch.setattr(bench, "ours", ours)
    monkeypatch.setattr(bench, "ensure_base", lambda *a, **k: None)
    argv = ["bench_e2e_trl.py", "--sizes", "large", "--seeds", "0", "1", "--repeats", "2"]
    monkeypatch.setattr(sys, "argv", [*argv, f"--trl-python={sys.executable}", f"--keep={tmp_path}"])
    bench.main()
    assert calls == [
        "trl0", "ours0.0", "ours0.1", "trl1", "ours1.0", "ours1.1", "ours_same_work", "ours_same_work"
    ]  # fmt: skip
