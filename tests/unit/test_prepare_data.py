"""tools/prepare_data.py without a network: local inputs (miniatures of the published files, and the real AIME
parquet where present), a stand-in downloader, overwrite rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dapo_megatron.commands import prepare_data
from dapo_megatron.data.loading import load_examples
from tests.conftest import REPO, real_data
from tests.sample_files import PROBLEMS, dapo_rows, gsm8k_rows, write_parquet

TOOL = REPO / "tools" / "prepare_data.py"


class FakeHub:
    """Serves local files for remote ones and records what was asked for."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files, self.requests = files, []

    def __call__(self, remote) -> Path:
        self.requests.append(remote)
        return self.files[f"{remote.repo_id}/{remote.filename}"]


def repeated_dapo_parquet(path: Path, unique: int, copies: int) -> Path:
    """A miniature of the public DAPO-Math-17k parquet: every prompt `copies` times, pass after pass."""
    return write_parquet(path, dapo_rows([(f"What is {i}+{i}?", str(2 * i)) for i in range(unique)], copies))


def aime_miniature(folder: Path) -> Path:
    """DAPO's AIME parquet in miniature: 3 problems, 4 shuffled copies each."""
    return write_parquet(folder / "aime-2024.parquet", dapo_rows(copies=4, seed=0))


@pytest.mark.parametrize(("source", "rows", "prompts"), [("miniature", 12, 3), ("real", 960, 30)])
def test_from_local_aime_round_trips_through_the_loader(
    tmp_path: Path, capsys, source: str, rows: int, prompts: int
) -> None:
    aime = aime_miniature(tmp_path) if source == "miniature" else real_data("aime-2024.dapo.parquet")
    out = tmp_path / "out"
    code = prepare_data.main(
        ["--output-dir", str(out), "--datasets", "aime-2024", "--from-local", f"aime_2024={aime}"],
        fetch=pytest.fail,
    )
    assert code == 0
    summary = f"{rows} rows read from 1 file(s), {rows - prompts} duplicates removed -> {prompts} prompts"
    assert f"aime_2024: {summary}" in capsys.readouterr().out
    written, stats = load_examples(out / "aime_2024.jsonl")
    original, _ = load_examples(aime)
    assert stats.rows_read == prompts and [p.name for p in out.iterdir()] == ["aime_2024.jsonl"]
    assert [(e.uid, e.ground_truth, e.messages, e.data_source) for e in written] == [
        (e.uid, e.ground_truth, e.messages, e.data_source) for e in original
    ]


def test_downloads_each_selected_file_and_converts_gsm8k(tmp_path: Path) -> None:
    published = tmp_path / "published"  # the hub's files: parquet with GSM8K's question/answer columns
    published.mkdir()
    hub = FakeHub(
        {
            "openai/gsm8k/main/train-00000-of-00001.parquet": write_parquet(
                published / "train.parquet", gsm8k_rows(PROBLEMS[:2])
            ),
            "openai/gsm8k/main/test-00000-of-00001.parquet": write_parquet(
                published / "test.parquet", gsm8k_rows([("Cents in $21.25?", "2,125"), *PROBLEMS])
            ),
        }
    )
    out = tmp_path / "out"
    code = prepare_data.main(
        ["--output-dir", str(out), "--datasets", "gsm8k", "--output-format", "parquet"], fetch=hub
    )
    assert code == 0 and [r.repo_id for r in hub.requests] == ["openai/gsm8k", "openai/gsm8k"]
    train, _ = load_examples(out / "gsm8k_train.parquet")
    test, _ = load_examples(out / "gsm8k_test.parquet")
    assert (len(train), len(test), test[0].ground_truth, test[0].data_source) == (2, 4, "2125", "gsm8k")
    row = pq.read_table(out / "gsm8k_test.parquet").slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["ground_truth"] == "2125"


@pytest.mark.parametrize(("flags", "expected_rows"), [((), 5), (("--no-dedup",), 15)])
def test_dapo_math_is_deduplicated_unless_asked_not_to(
    tmp_path: Path, flags: tuple[str, ...], expected_rows: int
) -> None:
    source = repeated_dapo_parquet(tmp_path / "raw.parquet", unique=5, copies=3)
    hub = FakeHub({"BytedTsinghua-SIA/DAPO-Math-17k/data/dapo-math-17k.parquet": source})
    assert (
        prepare_data.main(
            ["--output-dir", str(tmp_path / "out"), "--datasets", "dapo-math-17k", *flags], fetch=hub
        )
        == 0
    )
    lines = (tmp_path / "out" / "dapo_math_17k.jsonl").read_text().splitlines()
    assert len(lines) == expected_rows
    assert [json.loads(line)["reward_model"]["ground_truth"] for line in lines[:5]] == [
        "0",
        "2",
        "4",
        "6",
        "8",
    ]


def test_refuses_to_overwrite_without_force(tmp_path: Path, capsys) -> None:
    target = tmp_path / "aime_2024.jsonl"
    target.write_text("keep me\n")
    args = ["--output-dir", str(tmp_path), "--datasets", "aime-2024"]
    assert prepare_data.main(args, fetch=pytest.fail) == 1  # refused before downloading anything
    assert "already exist; pass --force" in capsys.readouterr().err and target.read_text() == "keep me\n"
    hub = FakeHub({"BytedTsinghua-SIA/AIME-2024/data/aime-2024.parquet": aime_miniature(tmp_path)})
    assert prepare_data.main([*args, "--force"], fetch=hub) == 0
    assert len(target.read_text().splitlines()) == 3


def test_bad_arguments_and_failed_downloads_are_reported(tmp_path: Path, capsys) -> None:
    args = ["--output-dir", str(tmp_path), "--datasets", "aime-2024"]
    assert prepare_data.main([*args, "--from-local", "gsm8k_test=x.jsonl"], fetch=pytest.fail) == 2
    assert "not an output of the selected data sets" in capsys.readouterr().err

    def offline(remote):
        raise prepare_data.DownloadError(f"could not download {remote.url()}")

    assert prepare_data.main(args, fetch=offline) == 1
    assert (
        "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/aime-2024.parquet"
        in capsys.readouterr().err
    )
    assert prepare_data.main([*args, "--from-local", f"aime_2024={tmp_path / 'nope.parquet'}"]) == 1
    assert "nope.parquet: no such file" in capsys.readouterr().err


def test_default_download_uses_the_hub_and_wraps_its_errors(monkeypatch, tmp_path: Path) -> None:
    calls = []

    def fake_hub_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(tmp_path / "file.parquet")

    monkeypatch.setattr(prepare_data, "hf_hub_download", fake_hub_download)
    remote = prepare_data.DATASETS["aime-2024"][0].source
    assert prepare_data.download(remote) == tmp_path / "file.parquet"
    assert calls == [
        (
            "BytedTsinghua-SIA/AIME-2024",
            "data/aime-2024.parquet",
            {"repo_type": "dataset", "revision": "main"},
        )
    ]

    def no_network(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(prepare_data, "hf_hub_download", no_network)
    with pytest.raises(prepare_data.DownloadError, match=r"network unreachable\. Fix: .*--from-local"):
        prepare_data.download(remote)


def test_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--output-dir",
            str(tmp_path),
            "--datasets",
            "aime-2024",
            "--from-local",
            f"aime_2024={aime_miniature(tmp_path)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "-> 3 prompts" in proc.stdout and (tmp_path / "aime_2024.jsonl").exists()
