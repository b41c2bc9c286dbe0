"""Loading prompt data sets: the real samples where present (tests/conftest.py's real_data), miniatures of
each published layout everywhere, format rules, de-duplication, error messages, and a data set built from
the config."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapo_megatron.data import char_tokenizer
from dapo_megatron.data.config import FORMATS, DataConfig
from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.formats import DAPO_INSTRUCTION, DAPO_REMINDER, dapo_prompt, detect_format
from dapo_megatron.data.loading import dataset_from_config, load_examples
from tests.conftest import real_data
from tests.sample_files import (
    PROBLEMS,
    dapo_rows,
    flat_aime_rows,
    gsm8k_rows,
    qwen_aime_rows,
    write_jsonl,
    write_parquet,
)

# The real samples: DAPO's AIME parquet (30 problems x 32 copies) and the smaller files beside it in
# ../shared/data; tools/prepare_data.py writes de-duplicated AIME and GSM8K copies as data/NAME.jsonl|parquet.
AIME_RAW = "aime-2024.dapo.parquet"
AIME_ANY = ("aime_2024.jsonl", "aime_2024.parquet", AIME_RAW)
GSM8K_TEST = ("gsm8k_test.jsonl", "gsm8k_test.parquet")
GSM8K_TRAIN = ("gsm8k_train.jsonl", "gsm8k_train.parquet", "gsm8k_train_first200.jsonl")

# dapo-semantics.md section 11 (order-free: that list orders II-13..15 differently from the AIME ids).
AIME_ANSWERS = Counter(
    [
        "204",
        "25",
        "809",
        "116",
        "104",
        "294",
        "540",
        "197",
        "480",
        "113",
        "371",
        "385",
        "110",
        "104",
        "721",
        "73",
        "236",
        "45",
        "33",
        "80",
        "55",
        "699",
        "127",
        "902",
        "468",
        "601",
        "23",
        "211",
        "315",
        "321",
    ]
)
# Distinctive problem text -> official answer (AIME 2024 I-1, I-7, I-15, II-13, II-15).
AIME_KNOWN = {
    "Every morning Aya goes for a $9$-kilometer-long walk": "204",
    "Find the largest possible real part of": "540",
    "rectangular boxes with surface area $54$ and volume $23$": "721",
    "be a 13th root of unity": "321",
    "inside a fixed regular dodecagon": "315",
}


def verl_row(problem: str, answer: object = "1", **extra: object) -> dict[str, object]:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": dapo_prompt(problem)}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        **extra,
    }


def answer_for(prompt: str) -> str:
    return next(answer for text, answer in AIME_KNOWN.items() if text in prompt)


@pytest.fixture(scope="module")
def plain_tokenizer():
    return char_tokenizer.build()


# --- the real files (skipped without them) ----------------------------------------------------------


def test_aime_2024_has_its_30_problems_with_the_official_answers() -> None:
    rows, stats = load_examples(real_data(*AIME_ANY))
    assert len(rows) == 30 and stats.conflicting_duplicates == 0
    assert Counter(r.ground_truth for r in rows) == AIME_ANSWERS
    assert {r.data_source for r in rows} == {"math_dapo"}
    assert all(r.prompt.startswith(DAPO_INSTRUCTION) and r.prompt.endswith(DAPO_REMINDER) for r in rows)
    known = [r for r in rows if any(text in r.prompt for text in AIME_KNOWN)]
    assert len(known) == len(AIME_KNOWN)
    assert all(r.ground_truth == answer_for(r.prompt) for r in known)


def test_dapo_aime_parquet_holds_32_copies_of_each_problem() -> None:
    path = real_data(AIME_RAW)
    rows, stats = load_examples(path)
    assert (stats.rows_read, stats.duplicates_removed, len(rows)) == (960, 930, 30)
    copies, _ = load_examples(path, dedup=False)
    assert len({r.uid for r in copies}) == 960
    assert Counter(Counter(r.uid.split("-")[0] for r in copies).values()) == {32: 30}


def test_the_aime_copies_agree() -> None:
    parquet, _ = load_examples(real_data(AIME_RAW))
    flat, _ = load_examples(real_data("aime2024_30.jsonl"))
    assert {r.uid: r.ground_truth for r in flat} == {r.uid: r.ground_truth for r in parquet}
    qwen, _ = load_examples(real_data("aime24_qwen25math_test.jsonl"))
    # Qwen's copy writes answers AIME-style with three digits ("023"). The loader keeps ground truths
    # verbatim, and DAPO's exact-match scorer would then reject "Answer: 23": evaluate on DAPO's file.
    # Its problem texts differ from DAPO's in details, so only the answers are compared.
    assert len(qwen) == 30 and "023" in {r.ground_truth for r in qwen}
    assert Counter(str(int(r.ground_truth)) for r in qwen) == AIME_ANSWERS
    known = [r for r in qwen if any(text in r.prompt for text in AIME_KNOWN)]
    assert known and all(int(r.ground_truth) == int(answer_for(r.prompt)) for r in known)


def test_dapo_math_sample() -> None:
    rows, stats = load_examples(real_data("dapo_math_17k_sample27.jsonl"))
    assert len(rows) == 27 and stats.duplicates_removed == 0
    assert [r.ground_truth for r in rows[:4]] == ["34", "113", "-3", "3"]
    assert {r.data_source for r in rows} == {"math_dapo"}
    assert all(
        r.prompt.startswith(DAPO_INSTRUCTION + "\n\n") and r.prompt.endswith("\n\n" + DAPO_REMINDER)
        for r in rows
    )


def test_gsm8k_files() -> None:
    """The published split or tools/prepare_data.py's conversion of it: the same prompts and answers."""
    test, stats = load_examples(real_data(*GSM8K_TEST))
    train, _ = load_examples(real_data(*GSM8K_TRAIN))
    assert (len(test), stats.rows_read, test[0].ground_truth) == (1319, 1319, "18")
    assert train[0].ground_truth == "72"
    assert {r.data_source for r in test} == {"gsm8k"}
    assert test[0].prompt.startswith(f"{DAPO_INSTRUCTION}\n\nJanet\u2019s ducks lay 16 eggs per day.")
    assert all(r.ground_truth.lstrip("-").replace(".", "", 1).isdigit() for r in test)  # "2,125" -> "2125"
    assert "2125" in {r.ground_truth for r in test}


# --- each published layout, in miniature ---------------------------------------------------------------


def test_dapo_aime_parquet_layout_dedups_and_numbers_the_copies(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "aime.parquet", dapo_rows(copies=4, seed=0))
    rows, stats = load_examples(path)
    assert (stats.rows_read, stats.duplicates_removed, stats.conflicting_duplicates) == (12, 9, 0)
    assert rows[0].origin.endswith("aime.parquet, row 0")
    by_answer = {r.ground_truth: r for r in rows}
    assert sorted(by_answer) == sorted(answer for _, answer in PROBLEMS)
    for problem, answer in PROBLEMS:
        assert by_answer[answer].prompt == dapo_prompt(problem)
        assert by_answer[answer].messages == ({"role": "user", "content": dapo_prompt(problem)},)
    assert {r.data_source for r in rows} == {"math_dapo"}
    copies, stats = load_examples(path, dedup=False)
    assert len(copies) == 12 and stats.duplicates_removed == 0 and len({r.uid for r in copies}) == 12
    assert Counter(Counter(r.uid.split("-")[0] for r in copies).values()) == {4: 3}
    first_copy = {r.uid.split("-")[0]: r.uid for r in reversed(copies)}
    assert set(first_copy.values()) == {r.uid for r in rows}  # the first copy keeps the bare uid


def test_flat_aime_layout_gives_the_parquets_uids(tmp_path: Path) -> None:
    parquet, _ = load_examples(write_parquet(tmp_path / "aime.parquet", dapo_rows(copies=2, seed=0)))
    path = write_jsonl(tmp_path / "aime_flat.jsonl", flat_aime_rows())
    flat, _ = load_examples(path)
    assert detect_format(flat_aime_rows()[0]) == "flat"
    assert {r.uid: r.ground_truth for r in flat} == {r.uid: r.ground_truth for r in parquet}
    assert flat[0].ground_truth == PROBLEMS[0][1] and flat[0].origin.endswith("aime_flat.jsonl, line 1")
    with pytest.raises(DatasetError, match=r"aime_flat\.jsonl, line 1: .*'prompt' must be a non-empty list"):
        load_examples(path, format="verl")
    renamed, _ = load_examples(path, data_source="aime_2024")
    assert {r.data_source for r in renamed} == {"aime_2024"}


def test_qwen_aime_layout_is_wrapped_and_keeps_three_digit_answers(tmp_path: Path) -> None:
    rows, _ = load_examples(write_jsonl(tmp_path / "qwen.jsonl", qwen_aime_rows()))
    assert [r.ground_truth for r in rows] == ["040", "009", "007"]
    assert [r.prompt for r in rows] == [dapo_prompt(problem) for problem, _ in PROBLEMS]
    assert {r.data_source for r in rows} == {"math_dapo"}


def test_dapo_math_layout(tmp_path: Path) -> None:
    rows, _ = load_examples(write_jsonl(tmp_path / "dapo.jsonl", dapo_rows()))
    assert [(r.prompt, r.ground_truth) for r in rows] == [(dapo_prompt(p), a) for p, a in PROBLEMS]
    assert rows[0].messages == ({"role": "user", "content": rows[0].prompt},)


def test_gsm8k_layout(tmp_path: Path) -> None:
    problems = [*PROBLEMS, ("How many cents are in $21.25?", "2,125")]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(problems))
    rows, _ = load_examples(path)
    assert [r.ground_truth for r in rows] == ["40", "9", "7", "2125"]
    assert [r.prompt for r in rows] == [dapo_prompt(problem) for problem, _ in problems]
    assert {r.data_source for r in rows} == {"gsm8k"}
    whole, _ = load_examples(path, format="flat")  # the whole solution becomes the answer
    assert whole[0].ground_truth == gsm8k_rows()[0]["answer"] and whole[0].ground_truth.endswith("#### 40")


# --- de-duplication --------------------------------------------------------------------------------


def test_dedup_keeps_first_occurrence_in_order_and_counts(tmp_path: Path) -> None:
    first = write_jsonl(
        tmp_path / "a.jsonl",
        [verl_row("A", "1"), verl_row("B", "2"), verl_row("  A ", "1"), verl_row("C", "3")],
    )
    second = write_jsonl(
        tmp_path / "b.jsonl", [{"problem": "B", "answer": "9"}, {"problem": "a", "answer": "4"}]
    )
    rows, stats = load_examples([first, second])
    assert [r.ground_truth for r in rows] == ["1", "2", "3", "4"]  # "a" != "A": case is kept
    assert (stats.rows_read, stats.duplicates_removed, stats.conflicting_duplicates, stats.final_size) == (
        6,
        2,
        1,
        4,
    )
    assert "2 duplicates removed" in stats.summary()

    kept, stats = load_examples([first, second], dedup=False)
    assert len(kept) == 6 and stats.duplicates_removed == 0
    assert [r.uid for r in kept][2] == kept[0].uid + "-2" and kept[4].uid == kept[1].uid + "-2"


# --- malformed rows ----------------------------------------------------------------------------------

GOOD = verl_row("good")
FLAT = {"problem": "good", "answer": 7}
MALFORMED = {  # case -> (a valid first row, which fixes the detected format; the bad row; the message)
    "invalid JSON": (GOOD, '{"prompt": [', "is not valid JSON"),
    "not an object": (GOOD, "[1, 2]", "is a JSON list, not an object"),
    "missing prompt": (GOOD, {"reward_model": {"ground_truth": "1"}}, "'prompt' must be a non-empty list"),
    "missing ground truth": (
        GOOD,
        {"prompt": [{"role": "user", "content": "q"}]},
        "no reward_model.ground_truth",
    ),
    "float ground truth": (GOOD, verl_row("q", 1.5), "must be a string or an integer, got float"),
    "empty ground truth": (GOOD, verl_row("q", " "), "ground truth 'reward_model.ground_truth' is empty"),
    "message not an object": (GOOD, {**GOOD, "prompt": ["hi"]}, r"prompt\[0\] must be an object"),
    "content not text": (
        GOOD,
        {**GOOD, "prompt": [{"role": "user", "content": 7}]},
        r"prompt\[0\]\.content must be a string",
    ),
    "empty prompt": (
        GOOD,
        {**GOOD, "prompt": [{"role": "user", "content": "  "}]},
        "the last one must have text",
    ),
    "bad data_source": (GOOD, {**GOOD, "data_source": 3}, "'data_source' must be a string"),
    "flat prompt not text": (FLAT, {"prompt": 5, "answer": "1"}, "field 'prompt' must be a string, got int"),
    "flat empty problem": (FLAT, {"problem": " ", "answer": 1}, "field 'problem' is empty"),
    "flat no answer": (FLAT, {"problem": "q"}, "has no answer"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_row_names_file_row_and_problem(tmp_path: Path, case: str) -> None:
    first, row, expected = MALFORMED[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [first, row])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl, line 2: .*{expected}") as raised:
        load_examples(path)
    assert (raised.value.path, raised.value.row) == (path, 2)


def test_undecodable_lines_gsm8k_errors_and_skipping(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"question": "q", "answer": "x #### 3"}\n\n\xff\xfe\n{"question": "q2", "answer": "no marker"}\n'
        + b'{"question": "q3", "answer": "#### 1", "id": '
        + b"9" * 5000
        + b"}\n"
    )
    with pytest.raises(DatasetError, match=r"bad\.jsonl, line 3: is not UTF-8"):
        load_examples(path)
    rows, stats = load_examples(path, skip_malformed=True)
    assert [r.ground_truth for r in rows] == ["3"] and (stats.rows_read, stats.malformed_skipped) == (4, 3)
    assert "line 4: field 'answer' has no '#### <final answer>'" in stats.malformed_examples[1]
    assert "line 5: cannot be decoded as JSON" in stats.malformed_examples[2]


def test_parquet_errors_name_the_row_index(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row("a"), verl_row("b", None)]), path)
    with pytest.raises(
        DatasetError, match=r"bad\.parquet, row 1: has no reward_model\.ground_truth"
    ) as raised:
        load_examples(path)
    assert raised.value.row == 1
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet: cannot read parquet"):
        load_examples(tmp_path / "junk.parquet")


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"missing\.jsonl: no such file"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported file type '\.csv'"):
        load_examples(tmp_path / "rows.csv")
    with pytest.raises(DatasetError, match="cannot tell the data format"):
        load_examples(write_jsonl(tmp_path / "odd.jsonl", [{"text": "hi", "label": 1}]))
    with pytest.raises(DatasetError, match="no data files given"):
        load_examples([])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
TEXT = st.text(max_size=6)
KEYS = st.sampled_from(
    ["prompt", "question", "problem", "answer", "ground_truth", "reward_model", "data_source"]
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.just("user") | JSON, "content": TEXT | JSON}) | JSON, max_size=2
)
VALID = st.one_of(  # rows of each format, with empty texts and integer answers now and then
    st.builds(verl_row, TEXT, TEXT | st.integers()),
    st.fixed_dictionaries({"problem": TEXT, "answer": TEXT | st.integers()}),
    st.fixed_dictionaries({"prompt": TEXT, "ground_truth": TEXT | st.integers()}),
    st.fixed_dictionaries({"question": TEXT, "answer": st.builds("{} #### {}".format, TEXT, TEXT)}),
)
ROW = st.one_of(
    VALID,
    VALID.flatmap(
        lambda row: st.builds(
            lambda key, value: {**row, key: value},  # one of its fields broken
            st.sampled_from(sorted(row)),
            JSON | MESSAGES,
        )
    ),
    st.dictionaries(KEYS, JSON | MESSAGES | st.fixed_dictionaries({"ground_truth": JSON}), max_size=4),
    JSON,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(ROW, min_size=1, max_size=4), fmt=st.sampled_from(FORMATS), skip=st.booleans())
def test_any_json_rows_load_or_raise_dataset_error(
    tmp_path: Path, rows: list[object], fmt: str, skip: bool
) -> None:
    path = tmp_path / "fuzz.jsonl"  # every row JSON-encoded, so one row is exactly one line
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        loaded, stats = load_examples(path, format=fmt, skip_malformed=skip)
    except DatasetError as error:
        assert "fuzz.jsonl" in str(error)
        return
    assert stats.rows_read == len(rows) == len(loaded) + stats.duplicates_removed + stats.malformed_skipped
    for example in loaded:
        assert example.prompt.strip() and example.ground_truth and example.data_source
        assert all(isinstance(m["content"], str) for m in example.messages)


# --- the data sets of a config ---------------------------------------------------------------------


def test_dataset_from_config(tmp_path: Path, plain_tokenizer) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows())
    eval_file = write_parquet(tmp_path / "eval.parquet", dapo_rows(copies=4, seed=0))
    config = DataConfig(train_files=[str(train_file)], eval_files=[str(eval_file)], seed=5)
    train = dataset_from_config(config, "train", plain_tokenizer, max_prompt_length=2048)
    evaluation = dataset_from_config(config, "eval", plain_tokenizer, max_prompt_length=2048)
    assert (len(train), train.shuffle, train.seed) == (3, True, 5)
    assert (len(evaluation), evaluation.shuffle, evaluation.stats.duplicates_removed) == (3, False, 9)
    assert evaluation.next_batch(2) == evaluation.take(2)
    with pytest.raises(ValueError, match=r"data\.overlong_prompt"):
        DataConfig(overlong_prompt="right")
