"""Download the public DAPO data sets and write them as de-duplicated local files the trainer reads.

    dapo-prepare-data --output-dir data [--datasets dapo-math-17k aime-2024 gsm8k]
        [--output-format jsonl] [--no-dedup] [--force] [--from-local gsm8k_test=test.parquet]

Data sets (Hugging Face hub, data set repositories):
    dapo-math-17k  BytedTsinghua-SIA/DAPO-Math-17k  data/dapo-math-17k.parquet -> dapo_math_17k
                   (1.79M rows, each prompt ~100 times; ~17.9k remain after de-duplication)
    aime-2024      BytedTsinghua-SIA/AIME-2024      data/aime-2024.parquet    -> aime_2024
                   (30 problems x 32 copies; 30 remain: evaluate with 32 samples per problem)
    gsm8k          openai/gsm8k  main/{train,test}-00000-of-00001.parquet     -> gsm8k_train, gsm8k_test
                   (questions wrapped in DAPO's prompt, ground truth = the number after ####)

Every output is written in verl's format (a chat `prompt` list, `reward_model.ground_truth`,
`data_source`), which `dapo_megatron.data.loading` reads back unchanged. Downloads use
`huggingface_hub` (its cache, HF_TOKEN and HF_ENDPOINT apply). `--from-local NAME=PATH` converts a file you
already have instead of downloading it (NAME is an output name above). Existing outputs are never
overwritten without --force.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import hf_hub_download

from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.formats import to_verl_row
from dapo_megatron.data.loading import load_examples
from dapo_megatron.data.stats import DatasetStats

HF_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hugging Face data set repository."""

    repo_id: str
    filename: str
    revision: str = "main"

    def url(self, endpoint: str = HF_ENDPOINT) -> str:
        return f"{endpoint.rstrip('/')}/datasets/{self.repo_id}/resolve/{self.revision}/{self.filename}"


@dataclass(frozen=True)
class Output:
    """One local file the tool writes, and where its rows come from."""

    name: str
    source: RemoteFile


DATASETS: dict[str, tuple[Output, ...]] = {
    "dapo-math-17k": (
        Output("dapo_math_17k", RemoteFile("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet")),
    ),
    "aime-2024": (Output("aime_2024", RemoteFile("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet")),),
    "gsm8k": (
        Output("gsm8k_train", RemoteFile("openai/gsm8k", "main/train-00000-of-00001.parquet")),
        Output("gsm8k_test", RemoteFile("openai/gsm8k", "main/test-00000-of-00001.parquet")),
    ),
}

Download = Callable[[RemoteFile], Path]
"""Fetches one remote file and returns its local path; tests pass a stand-in for the network."""


class DownloadError(RuntimeError):
    """A remote file could not be fetched; the message says which and what to try."""


def download(remote: RemoteFile) -> Path:
    """Fetch ``remote`` through huggingface_hub (its cache, retries, HF_TOKEN and HF_ENDPOINT apply)."""
    try:
        return Path(
            hf_hub_download(remote.repo_id, remote.filename, repo_type="dataset", revision=remote.revision)
        )
    except Exception as error:  # network, auth and hub errors all end the same way: say what failed
        raise DownloadError(
            f"could not download {remote.url()}: {error}. Fix: check the network (and HF_TOKEN "
            "or HF_ENDPOINT), or download the file yourself and pass --from-local."
        ) from error


def write_rows(rows: list[dict], target: Path) -> None:
    """Write ``rows`` as jsonl or parquet (by ``target``'s suffix), atomically."""
    partial = target.with_name(target.name + ".partial")
    if target.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), partial)
    else:
        with partial.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(target)


def convert(source: Path, target: Path, *, dedup: bool) -> DatasetStats:
    """Read ``source`` in any format the loader knows and write it to ``target`` in verl's format."""
    examples, stats = load_examples(source, dedup=dedup)
    write_rows([to_verl_row(example, index) for index, example in enumerate(examples)], target)
    return stats


def parse_local_files(pairs: Sequence[str], outputs: Sequence[Output]) -> dict[str, Path]:
    """``NAME=PATH`` arguments as a mapping; NAME must be one of the selected outputs."""
    names = [output.name for output in outputs]
    local = {}
    for pair in pairs:
        name, separator, path = pair.partition("=")
        if not separator or not path:
            raise ValueError(f"--from-local expects NAME=PATH; got {pair!r}")
        if name not in names:
            raise ValueError(
                f"--from-local {name}: not an output of the selected data sets; choose from {names}"
            )
        local[name] = Path(path)
    return local


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", required=True, type=Path, help="directory for the prepared files")
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=sorted(DATASETS),
        default=sorted(DATASETS),
        help="data sets to prepare (default: all)",
    )
    parser.add_argument("--output-format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument(
        "--no-dedup",
        action="store_true",
        help="keep repeated prompts (e.g. AIME's 32 copies for one sample per row)",
    )
    parser.add_argument(
        "--from-local",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="convert this local file for output NAME instead of downloading it",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, fetch: Download = download) -> int:
    args = parse_args(argv)
    outputs = [output for name in dict.fromkeys(args.datasets) for output in DATASETS[name]]
    try:
        local = parse_local_files(args.from_local, outputs)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    targets = {output.name: args.output_dir / f"{output.name}.{args.output_format}" for output in outputs}
    existing = [str(path) for path in targets.values() if path.exists()]
    if existing and not args.force:  # checked before any download, which can take minutes
        print(f"error: {', '.join(existing)} already exist; pass --force to overwrite", file=sys.stderr)
        return 1
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for output in outputs:
        started = time.time()
        try:
            source = local.get(output.name) or fetch(output.source)
            stats = convert(source, targets[output.name], dedup=not args.no_dedup)
        except (DatasetError, DownloadError) as error:
            print(f"error: {output.name}: {error}", file=sys.stderr)
            return 1
        print(f"{output.name}: {stats.summary()} -> {targets[output.name]} ({time.time() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
