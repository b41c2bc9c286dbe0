"""bench/run.py's collection logic on fake benchmarks (tiny scripts), never the real, slow benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, load_bench_script

run = load_bench_script("run")


def write_bench(directory: Path, name: str, body: str) -> None:
    (directory / f"bench_{name}.py").write_text(body)


@pytest.fixture
def fake_benches(tmp_path: Path) -> Path:
    bench = tmp_path / "bench"
    bench.mkdir()
    write_bench(
        bench,
        "good",
        "import argparse, json\n"
        'p = argparse.ArgumentParser(); p.add_argument("--json"); a = p.parse_args()\n'
        'print("some progress 12 tokens/s")\n'
        'print("logprob_peak_mem_vs_naive 0.210")\n'
        'print("logprob_time_vs_naive 1.5")\n'
        'if a.json: open(a.json, "w").write(json.dumps({"peak_bytes": 7}))\n',
    )
    write_bench(
        bench,
        "sync",
        'print("tensor_sync_bytes_per_s_vs_memcpy 0.19")\n'
        'print("distributed_sync_bytes_per_s_vs_memcpy 0.61")\n'
        'print("time_to_accuracy_vs_trl None")\n',
    )
    write_bench(
        bench,
        "broken",
        'import sys\nprint("real_token_fraction 0.99")\n'
        'sys.stderr.write("Traceback\\nValueError: the engine died\\n")\nsys.exit(3)\n',
    )
    return bench


def test_parse_ratios_reads_only_key_value_lines() -> None:
    out = (
        "step 3/10 | loss 0.1\nmodel 110M parameters\nfoo_vs_bar 0.5\nfoo_vs_bar 0.7\nx nan\ny None\nz 1e-3\n"
    )
    # A repeated key keeps its last value; nan and None mean "not measured".
    assert run.parse_ratios(out) == {"foo_vs_bar": 0.7, "x": None, "y": None, "z": 1e-3}


def test_summary_has_every_issue_key_and_derives_sync_from_the_best_method() -> None:
    results = [
        run.Result(
            "sync",
            "ok",
            1.0,
            ratios={"tensor_sync_bytes_per_s_vs_memcpy": 0.2, "distributed_sync_bytes_per_s_vs_memcpy": 0.6},
        ),
        run.Result("x", "failed", 1.0),
    ]
    values = run.summary(results)
    assert set(run.REQUIRED_KEYS) <= set(values)
    assert values["sync_bytes_per_s_vs_memcpy"] == 0.6
    assert values["real_token_fraction"] is None


def test_verdicts_follow_the_targets_direction() -> None:
    assert run.verdict("logprob_peak_mem_vs_naive", 0.21).endswith("met")
    assert run.verdict("logprob_time_vs_naive", 1.5).endswith("MISSED")
    assert run.verdict("e2e_throughput_vs_trl", 1.2).endswith("MISSED")
    assert run.verdict("e2e_throughput_vs_trl", None).endswith("not measured")
    assert run.verdict("rollout_tokens_per_s_vs_stock", 0.5) == ""  # reported, no target
    assert run.verdict("logprob_time_vs_naive", 1.5, judge=False) == "<= 1.2"  # quick numbers are not judged
    # The peer never reached the accuracy: a bound below the target meets it, one above it measures nothing.
    assert run.verdict("time_to_accuracy_vs_trl", None, upper_bound=0.4).startswith(
        "<= 0.5: met (below 0.400"
    )
    assert run.verdict("time_to_accuracy_vs_trl", None, upper_bound=0.9).endswith("not measured")
    assert run.verdict("e2e_throughput_vs_trl", None, upper_bound=0.5).endswith("not measured")


def test_failed_benchmark_is_reported_and_the_rest_still_run(
    fake_benches: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ratios.json"
    code = run.main(["--bench-dir", str(fake_benches), "--json", str(out), "--timeout", "60"])
    assert code == 1  # one benchmark failed
    printed = capsys.readouterr().out
    assert "ValueError: the engine died" in printed  # the failure's stderr tail is in the table's footer
    report = json.loads(out.read_text())
    assert set(run.REQUIRED_KEYS) <= set(report)
    assert report["logprob_peak_mem_vs_naive"] == 0.21
    assert report["sync_bytes_per_s_vs_memcpy"] == 0.61
    assert report["time_to_accuracy_vs_trl"] is None
    # A failed run's ratios are not trusted, even those it printed before failing.
    assert report["real_token_fraction"] is None
    benches = report["benchmarks"]
    assert [benches[n]["status"] for n in ("broken", "good", "sync")] == ["failed", "ok", "ok"]
    assert benches["good"]["details"] == {"peak_bytes": 7}  # --json passed because the script takes it
    assert "--json" not in benches["sync"]["command"]


def test_only_runs_the_named_benchmark_and_timeout_counts_as_failure(
    fake_benches: Path, tmp_path: Path
) -> None:
    write_bench(fake_benches, "slow", "import time\ntime.sleep(30)\n")
    out = tmp_path / "ratios.json"
    assert (
        run.main(["--bench-dir", str(fake_benches), "--only", "slow", "--timeout", "1", "--json", str(out)])
        == 1
    )
    benches = json.loads(out.read_text())["benchmarks"]
    assert list(benches) == ["slow"]
    assert benches["slow"]["status"] == "timeout"
    assert run.main(["--bench-dir", str(fake_benches), "--only", "good", "--json", str(out)]) == 0


def test_the_large_e2e_size_runs_only_with_large(fake_benches: Path, tmp_path: Path) -> None:
    write_bench(
        fake_benches,
        "e2e_trl",
        'import sys\nprint("e2e_throughput_vs_trl_demo 0.5")\n'
        '"large" in sys.argv and print("e2e_throughput_vs_trl 1.7")\n',
    )
    out = tmp_path / "ratios.json"
    for flags, sizes, headline in (([], ["demo"], None), (["--large"], ["demo", "large"], 1.7)):
        assert (
            run.main(["--bench-dir", str(fake_benches), "--only", "e2e_trl", "--json", str(out), *flags]) == 0
        )
        report = json.loads(out.read_text())
        command = report["benchmarks"]["e2e_trl"]["command"]
        last = len(command) - 1 - command[::-1].index("--sizes")  # the one argparse keeps
        assert command[last + 1 :] == sizes
        assert report["e2e_throughput_vs_trl_demo"] == 0.5 and report["e2e_throughput_vs_trl"] == headline
        assert "time_to_accuracy_vs_trl" in report


def test_only_rejects_an_unknown_name(fake_benches: Path) -> None:
    with pytest.raises(SystemExit):
        run.main(["--bench-dir", str(fake_benches), "--only", "nope"])


def test_help_runs_as_a_script() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    assert "--quick" in proc.stdout and "--only" in proc.stdout
