"""The console and the metric loggers: the `dapo_megatron` logger's levels and handler, the step line,
TensorBoard and metrics.jsonl, a Weights & Biases run in offline mode read back from its files, the saved
config, and the warnings filters for checkpoint loading."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from dapo_megatron import config as job_config
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.metrics import MetricsLogger, configure_console, console, format_duration
from dapo_megatron.records import ScoredGroup, ScoredSample
from dapo_megatron.trainer import startup
from dapo_megatron.trainer.batch import build_rows, policy_lag
from dapo_megatron.trainer.evaluate import ProblemOutcome, eval_metrics
from dapo_megatron.trainer.step_metrics import Progress, console_line
from tests.metric_tags import documented, readme_tags


@contextlib.contextmanager
def bare_logging() -> Iterator[None]:
    """Logging as a fresh process has it: no root handlers (pytest adds its capture handler to the root for
    each test's call), the package logger without its handler; restored afterwards."""
    root = logging.getLogger()
    saved_root, saved_own, saved_level = root.handlers[:], console.handlers[:], console.level
    root.handlers.clear()
    console.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:], console.handlers[:] = saved_root, saved_own
        console.setLevel(saved_level)


@bare_logging()
def test_console_logs_info_on_the_logging_rank_and_warnings_everywhere(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_console(logging_rank=True)
    configure_console(logging_rank=True)  # a second set-up (warm-up, then training) adds no second handler
    console.info("step 1/2 | score 0.5")
    console.getChild("checkpoint").warning("skipped iter_0000002")
    assert capsys.readouterr().out == "step 1/2 | score 0.5\nWARNING: skipped iter_0000002\n"

    configure_console(logging_rank=False)
    console.info("not on other ranks")
    console.warning("but their warnings")
    assert capsys.readouterr().out == "WARNING: but their warnings\n"

    configure_console(logging_rank=True, level="warning")  # trainer.log_level=WARNING quiets the step lines
    console.info("quiet")
    assert capsys.readouterr().out == ""
    with pytest.raises(
        ValueError, match=r"trainer\.log_level must be DEBUG, INFO, WARNING or ERROR; got 'LOUD'"
    ):
        configure_console(logging_rank=True, level="LOUD")


@bare_logging()
def test_an_application_that_configured_logging_keeps_its_handlers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logging.basicConfig(filename=tmp_path / "app.log", format="%(name)s %(message)s", force=True)
    try:
        configure_console(logging_rank=True)
        console.info("step 1/2")
    finally:
        for handler in logging.getLogger().handlers:
            handler.close()
    assert capsys.readouterr().out == ""
    assert (tmp_path / "app.log").read_text() == "dapo_megatron step 1/2\n"


STEP = {
    "critic/score/mean": 0.25,
    "rollout/accuracy": 0.625,
    "dynamic_sampling/keep_ratio": 0.5,
    "dynamic_sampling/gen_rounds": 2.0,
    "response_length/mean": 10.5,
    "actor/pg_loss": 0.001,
    "actor/pg_clipfrac": 0.004,
    "actor/entropy": 0.3,
    "actor/grad_norm": 2.0,
    "timing_s/step": 3.14,
    "timing_s/gen": 1.0,
    "timing_s/update_actor": 2.0,
    "timing_s/update_weights": 0.1,
}


def test_step_line_shows_elapsed_eta_and_the_last_evaluation() -> None:
    line = console_line(41, 80, STEP, Progress(elapsed=161.0, eta=122.4, last_eval=(40, 0.33)))
    assert line == (
        "step 41/80 | score 0.250 | acc 0.625 | keep 0.500 | rounds 2 | resp_len 10.500 | pg_loss 0.001 | "
        "clipfrac 0.004 | entropy 0.300 | grad_norm 2.000 | eval_acc 0.330 (step 40) | "
        "t 3.1s (gen 1.0 train 2.0 sync 0.1) | elapsed 2m41s | eta 2m02s"
    )
    assert "| eval_acc 0.330 | t" in console_line(40, 80, STEP, Progress(161.0, 122.4, last_eval=(40, 0.33)))
    assert "eval_acc" not in console_line(1, 80, STEP, Progress(elapsed=5.0, eta=400.0))
    assert [format_duration(s) for s in (0.4, 59.6, 3599, 3600, 90061)] == [
        "0s",
        "1m00s",
        "59m59s",
        "1h00m",
        "25h01m",
    ]


def test_tensorboard_and_jsonl_on_the_logging_rank_only(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "tb", enabled=True) as metrics:
        metrics.log({"critic/score/mean": 0.5, "timing_s/step": 2}, step=3)
    records = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 3, "critic/score/mean": 0.5, "timing_s/step": 2.0}]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1

    with MetricsLogger(tmp_path / "jsonl_only", enabled=True, loggers=["jsonl"]) as metrics:
        metrics.log({"x": 1.0}, step=0)
    assert [p.name for p in (tmp_path / "jsonl_only").iterdir()] == ["metrics.jsonl"]

    with MetricsLogger(
        tmp_path / "other_rank", enabled=False, loggers=["tensorboard", "jsonl", "wandb"]
    ) as m:
        m.log({"x": 1.0}, step=0)
    assert not (tmp_path / "other_rank").exists()
    with pytest.raises(ValueError, match=r"trainer.loggers: unknown \['wandb_'\]"):
        MetricsLogger(tmp_path, enabled=True, loggers=["wandb_"])


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The protobuf records of an offline run's `run-<id>.wandb`: a 7-byte header, then LevelDB-style log
    blocks of 32 KiB whose chunks (7-byte header: checksum, length, type full/first/middle/last) carry one
    record each or split over several."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    position, parts = 7, []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        parts = [chunk] if kind in (1, 2) else [*parts, chunk]
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def test_wandb_offline_run_holds_the_scalars_and_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    resolved = startup.resolved_config(job_config.to_job_config(job_config.compose(["experiment=demo"])))
    with MetricsLogger(
        tmp_path / "tensorboard", enabled=True, loggers=["wandb"], config=resolved, run_name="demo"
    ) as metrics:
        metrics.log({"startup/total_s": 9.5}, step=0)
        metrics.log({"critic/score/mean": 0.25, "val-core/math_dapo/acc/mean@1": 0.5}, step=1)
        metrics.log({"critic/score/mean": 0.75}, step=2)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's service process writes the file; `finish` can return before the last records reach the disk.
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file)):
        assert time.monotonic() < deadline, "the offline run file never got its exit record"
        time.sleep(0.2)
    history, config, name = [], {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
            name = record.run.display_name if kind == "run" else name
    assert history == [
        {"_step": 0, "startup/total_s": 9.5},
        {"_step": 1, "critic/score/mean": 0.25, "val-core/math_dapo/acc/mean@1": 0.5},
        {"_step": 2, "critic/score/mean": 0.75},
    ]
    assert name == "demo"
    assert config["trainer"]["train_batch_size"] == 32 and config["experiment_name"] == "demo"


def test_saved_config_is_the_resolved_job(tmp_path: Path) -> None:
    """config.yaml holds every field after the overrides, and loads back into the same job."""
    job = job_config.to_job_config(job_config.compose(["experiment=demo", "trainer.total_steps=7"]))
    path = startup.save_config(startup.resolved_config(job), tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    saved = OmegaConf.load(path)
    assert saved.trainer.total_steps == 7 and saved.output_dir == "outputs/demo"
    assert job_config.to_job_config(OmegaConf.merge(job_config.compose([]), saved)) == job


@pytest.mark.parametrize(
    ("message", "module", "silenced"),
    [
        (
            "`load_state_dict` is deprecated and will be removed",
            "megatron.core.dist_checkpointing.strategies.torch",
            True,
        ),
        (
            "Please use DTensor instead and we are deprecating ShardedTensor.",
            "torch.distributed.checkpoint.planner_helpers",
            True,
        ),
        # The same words elsewhere, or another deprecation from the same module, still show.
        ("`load_state_dict` is deprecated and will be removed", "dapo_megatron.trainer.actor", False),
        ("`save_state_dict` is deprecated", "megatron.core.dist_checkpointing.strategies.torch", False),
    ],
)
def test_checkpoint_loading_deprecations_are_silenced_and_nothing_else(
    message: str, module: str, silenced: bool
) -> None:
    from dapo_megatron.checkpoint import install_warning_filters

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_warning_filters()
        warnings.warn_explicit(message, FutureWarning, "x.py", 1, module=module)
    assert (len(caught) == 0) == silenced


VERL_NAMES = [
    *(f"critic/{q}/{s}" for q in ("score", "rewards", "advantages") for s in ("mean", "max", "min")),
    *(f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
    *(f"prompt_length/{s}" for s in ("mean", "max", "min")),
    *(f"timing_s/{s}" for s in ("gen", "old_log_prob", "update_actor", "update_weights", "testing", "step")),
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "perf/throughput",
    "perf/total_num_tokens",
    "val-core/<data_source>/acc/mean@<k>",
    "val-core/<data_source>/acc/best@<k>/mean",
]
"""verl's names for quantities this trainer logs too (verl/trainer/ppo/metric_utils.py, ray_trainer.py)."""


def test_readme_table_documents_what_the_batch_and_evaluation_write() -> None:
    """The fast half of the check (the demo run in tests/e2e/test_demo.py does the rest): the README table has
    verl's names, and every tag the batch builder, the policy-lag report and the evaluation write."""
    tags = readme_tags()
    assert [name for name in VERL_NAMES if name not in tags] == []
    right = ScoredSample([5, 6], [7, 8], [-0.1, -0.2], "stop", 1.0, True, weight_version="step-1")
    cut = ScoredSample([5], [7, 8, 9], [-0.3, -0.4, -0.5], "length", -1.0, False, weight_version="step-0")
    groups = [ScoredGroup("a", [right, cut])]
    _, batch = build_rows(groups, AlgoConfig(overlong_buffer_length=2), max_response_length=3, pad_token_id=0)
    several = [ProblemOutcome("aime", 1, (3, 4)), ProblemOutcome("gsm8k", 0, (5, 5))]
    evaluation = eval_metrics(several, k=2)
    written = [*batch, *policy_lag(groups, 1), *evaluation, "timing_s/testing"]
    assert [name for name in written if not documented(name, tags)] == []
    assert all(tags[name] == "every step" for name in [*batch, *policy_lag(groups, 1)])
