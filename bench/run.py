#!/usr/bin/env python
"""Run every benchmark under bench/ and collect their ratios into one table (and, with --json, one file).

    python bench/run.py [--quick] [--large] [--only NAME ...] [--json PATH] [--timeout SECONDS]

Each `bench/bench_<name>.py` runs as its own subprocess (one at a time: the machine has two cores) and
prints its ratios last, one `key value` line each; those lines are what this script reads, so a
benchmark needs no import of this file. Benchmarks that take `--json` also write their details, which
land under `benchmarks.<name>.details` of the output file. A benchmark that fails or times out is shown as
failed, with the tail of its output, and the others still run; the exit status is 1 when any failed.

`--quick` shrinks every benchmark to a smoke test (seconds to a few minutes each): its numbers check that
the pipeline works and mean nothing about performance. The output file holds at least the target keys
(`REQUIRED_KEYS`; `None` where a benchmark did not run or failed), each benchmark's status, time, ratios and
the load average around it (the machine is shared: a high load marks a number to rerun).

`--large` adds the ~30M-parameter size of e2e_trl, which carries the headline keys
(`e2e_throughput_vs_trl`, `time_to_accuracy_vs_trl`). On the 2-core machine it takes hours, far longer than
the ~50 minutes of the whole default suite (its longest parts: e2e_trl's demo size, three seeds per side,
~20 minutes, and overlap_learning, nine demo runs, ~15 minutes; bench/RESULTS.md gives each run's wall
time), so the default run leaves it out and reports those keys as None; give it a longer `--timeout` (e.g.
14400).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent

REQUIRED_KEYS = (
    "e2e_throughput_vs_trl",
    "e2e_throughput_synchronous_vs_trl",
    "time_to_accuracy_vs_trl",
    "e2e_throughput_vs_trl_demo",
    "e2e_throughput_synchronous_vs_trl_demo",
    "time_to_accuracy_vs_trl_demo",
    "startup_s_vs_trl_demo",
    "generated_per_trained_vs_batch_sync",
    "generated_per_trained_vs_batch_sync_min",
    "sync_bytes_per_s_vs_memcpy",
    "train_flops_fraction_of_gemm_peak",
    "logprob_peak_mem_vs_naive",
    "logprob_time_vs_naive",
    "real_token_fraction",
    "rollout_tokens_per_s_vs_stock",
    "kv_rollouts_held_vs_concurrency_32b",
)
"""The keys with a target in `TARGETS` or reported beside them (the leanest batch-sync baseline,
bench_rollout's), always present in the JSON output."""

TARGETS: dict[str, tuple[str, float]] = {
    "e2e_throughput_vs_trl": (">=", 2.0),
    "e2e_throughput_synchronous_vs_trl": (">=", 1.5),
    "time_to_accuracy_vs_trl": ("<=", 0.5),
    "e2e_throughput_vs_trl_demo": (">=", 1.0),
    "e2e_throughput_synchronous_vs_trl_demo": (">=", 1.0),
    "time_to_accuracy_vs_trl_demo": ("<=", 1.0),
    "startup_s_vs_trl_demo": ("<=", 1.5),
    "generated_per_trained_vs_batch_sync": ("<=", 0.7),
    "sync_bytes_per_s_vs_memcpy": (">=", 0.8),
    "train_flops_fraction_of_gemm_peak": (">=", 0.5),
    "logprob_peak_mem_vs_naive": ("<=", 0.25),
    "logprob_time_vs_naive": ("<=", 1.2),
    "real_token_fraction": (">=", 0.95),
    "kv_rollouts_held_vs_concurrency_32b": (">=", 0.5),
}
"""The benchmark targets (bench/RESULTS.md, 'Targets')."""


@dataclass(frozen=True)
class Spec:
    """How to run one benchmark: its extra arguments for a full and for a --quick run."""

    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    large: tuple[str, ...] = ()
    """Appended with --large (after `full` or `quick`, so a repeated option such as --sizes overrides
    theirs)."""


SPECS: dict[str, Spec] = {
    "logprobs": Spec(quick=("--tokens", "128", "--vocab", "16384", "--repeats", "1")),
    "weight_sync": Spec(quick=("--layers", "2", "--hidden", "128", "--vocab", "4096", "--repeats", "2")),
    "rollout": Spec(quick=("--prompts", "4", "--group", "4", "--rounds", "1")),
    "padding": Spec(quick=("--mini-batches", "2")),
    "dynamic_sampling": Spec(quick=("--quick",)),
    "update_flops": Spec(quick=("--size", "demo", "--steps", "1")),
    "overlap_learning": Spec(
        quick=("--seeds", "0", "--steps", "2", "--eval-every", "1", "--eval-problems", "20", "--late", "1")
    ),
    "e2e_trl": Spec(
        full=("--seeds", "0", "1", "2", "--sizes", "demo"),
        quick=("--quick", "--sizes", "demo"),
        large=("--sizes", "demo", "large"),
    ),
}
"""Benchmarks found under bench/ but missing here run with their defaults in both modes."""

RATIO_LINE = re.compile(r"^([A-Za-z_][\w@.]*)[ \t]+(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|-?inf|None)$")


@dataclass
class Result:
    name: str
    status: str  # ok | failed | timeout
    seconds: float
    ratios: dict[str, float | None] = field(default_factory=dict)
    details: Any = None
    output_tail: str = ""
    command: list[str] = field(default_factory=list)
    load_before: float = 0.0
    load_after: float = 0.0


def discover(bench_dir: Path) -> dict[str, Path]:
    """`bench_<name>.py` files, by name, in a stable order."""
    return {path.stem.removeprefix("bench_"): path for path in sorted(bench_dir.glob("bench_*.py"))}


def parse_ratios(stdout: str) -> dict[str, float | None]:
    """Every `key value` line of a benchmark's output; a later line wins over an earlier one with the same
    key. `None` (a benchmark's way of saying "not reached"), nan and inf become None, so the JSON stays
    strict."""
    ratios: dict[str, float | None] = {}
    for line in stdout.splitlines():
        match = RATIO_LINE.match(line.strip())
        if match:
            value = None if match.group(2) == "None" else float(match.group(2))
            ratios[match.group(1)] = value if value is not None and math.isfinite(value) else None
    return ratios


def accepts_json(script: Path) -> bool:
    # Reading the source is enough and costs nothing; asking `--help` would import torch in every benchmark.
    return '"--json"' in script.read_text()


def run_one(
    name: str, script: Path, *, quick: bool, timeout: float, scratch: Path, large: bool = False
) -> Result:
    spec = SPECS.get(name, Spec())
    command = [
        sys.executable,
        str(script),
        *(spec.quick if quick else spec.full),
        *(spec.large if large else ()),
    ]
    details_path = scratch / f"{name}.json"
    if accepts_json(script):
        command += ["--json", str(details_path)]
    print(f"[run] {name}: {' '.join(command)}", flush=True)
    load_before, started = os.getloadavg()[0], time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=BENCH_DIR.parent)
        status, stdout, stderr = ("ok" if proc.returncode == 0 else "failed"), proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as error:
        status = "timeout"
        stdout, stderr = _text(error.stdout), _text(error.stderr) + f"\n(killed after {timeout:.0f}s)"
    seconds = time.perf_counter() - started
    details = json.loads(details_path.read_text()) if status == "ok" and details_path.exists() else None
    # A failed benchmark's stderr says why; a successful one's is mostly progress noise, keep its stdout.
    tail_source = stderr if status != "ok" and stderr.strip() else stdout
    return Result(
        name=name,
        status=status,
        seconds=seconds,
        ratios=parse_ratios(stdout) if status == "ok" else {},
        details=details,
        output_tail="\n".join(tail_source.strip().splitlines()[-15:]),
        command=command,
        load_before=load_before,
        load_after=os.getloadavg()[0],
    )


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def summary(results: list[Result]) -> dict[str, float | None]:
    """The `REQUIRED_KEYS` from every benchmark's ratios (None where none reported it), plus all other
    ratios."""
    merged: dict[str, float | None] = {}
    for result in results:
        merged.update(result.ratios)
    if "sync_bytes_per_s_vs_memcpy" not in merged:
        # bench_weight_sync reports each sync method; the job runs whichever is configured, so the best
        # counts.
        per_method = [
            v for k, v in merged.items() if k.endswith("_sync_bytes_per_s_vs_memcpy") and v is not None
        ]
        if per_method:
            merged["sync_bytes_per_s_vs_memcpy"] = max(per_method)
    return {**{key: merged.get(key) for key in REQUIRED_KEYS}, **merged}


def verdict(key: str, value: float | None, *, judge: bool = True, upper_bound: float | None = None) -> str:
    """The target, and whether `value` meets it; `judge=False` (smoke-test numbers) shows the target only.
    `upper_bound`: where `value` could not be measured (the peer never reached the accuracy), the ratio is
    known to be below this; it meets a `<=` target it does not exceed."""
    if key not in TARGETS:
        return ""
    op, threshold = TARGETS[key]
    if not judge:
        return f"{op} {threshold}"
    if value is None:
        if upper_bound is not None and op == "<=" and upper_bound <= threshold:
            return f"{op} {threshold}: met (below {upper_bound:.3f}: the peer never reached it)"
        return f"{op} {threshold}: not measured"
    met = value >= threshold if op == ">=" else value <= threshold
    return f"{op} {threshold}: {'met' if met else 'MISSED'}"


def render(results: list[Result], values: dict[str, float | None], *, quick: bool = False) -> str:
    rows = [("benchmark", "status", "time", "load", "key", "value", "target")]
    reported: set[str] = set()
    for result in results:
        load = f"{result.load_before:.1f}->{result.load_after:.1f}"
        head = (result.name, result.status, f"{result.seconds:.0f}s", load)
        if not result.ratios:
            rows.append((*head, "-", "-", ""))
        for i, (key, value) in enumerate(result.ratios.items()):
            reported.add(key)
            rows.append((*(head if i == 0 else ("",) * 4), key, _fmt(value), judged(key, values, quick)))
    for key in REQUIRED_KEYS:  # derived or missing keys still get a row, so nothing silently disappears
        if key not in reported:
            rows.append(("", "", "", "", key, _fmt(values.get(key)), judged(key, values, quick)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["--quick: smoke-test sizes, the numbers say nothing about the targets"] if quick else []
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    for result in results:
        if result.status != "ok":
            lines += ["", f"--- {result.name} {result.status}; last lines of its output:", result.output_tail]
    return "\n".join(lines)


def judged(key: str, values: dict[str, float | None], quick: bool) -> str:
    return verdict(key, values.get(key), judge=not quick, upper_bound=values.get(f"{key}_upper_bound"))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shrink every benchmark to a smoke test")
    parser.add_argument(
        "--large",
        action="store_true",
        help="also run e2e_trl's ~30M size (the headline keys; hours on 2 cores, raise --timeout)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these (e.g. logprobs e2e_trl)")
    parser.add_argument("--json", type=Path, help="write the ratios and per-benchmark details here")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per benchmark before it counts as failed"
    )
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR, help=argparse.SUPPRESS)  # for the tests
    args = parser.parse_args(argv)

    found = discover(args.bench_dir)
    names = list(found)
    if args.only:
        unknown = [name for name in args.only if name not in found]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; found: {', '.join(found)}")
        names = args.only
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            results.append(
                run_one(
                    name,
                    found[name],
                    quick=args.quick,
                    timeout=args.timeout,
                    scratch=Path(scratch),
                    large=args.large,
                )
            )
            print(f"[run] {name}: {results[-1].status} in {results[-1].seconds:.0f}s", flush=True)
    values = summary(results)
    print(render(results, values, quick=args.quick))
    if args.json:
        report = {
            **values,
            "quick": args.quick,
            "machine": machine(),
            "targets": TARGETS,
            "benchmarks": {r.name: asdict(r) for r in results},
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"[run] wrote {args.json}")
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
