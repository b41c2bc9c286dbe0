"""DAPO's math scorer: hand cases, the real AIME / DAPO-Math rows, and robustness on arbitrary text."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.rewards.math_dapo import (
    INVALID,
    compute_score,
    last_boxed_only_string,
    normalize_final_answer,
    remove_boxed,
)
from tests.conftest import real_data

REASONING = "Let me think step by step. We compute the sum 12 + 30 = 42, then use $x^2 = 4$.\n" * 30

# (response, ground truth, expected acc, expected pred)
HAND_CASES = [
    ("Step 1 ... so the result follows.\nAnswer: 540", "540", True, "540"),
    ("Answer: 0540", "540", False, "0540"),  # exact string match: no numeric equivalence
    ("Answer: \\frac{1}{2}", "0.5", False, "\\frac{1}{2}"),
    ("Answer: $540$", "540", True, "540"),
    ("Answer: 541", "540", False, "541"),
    ("The answer is \\boxed{540}.", "540", False, INVALID),
    ("Answer: 12\nmore thoughts\nAnswer: 540", "540", True, "540"),  # the last Answer: wins
    ("Answer: 540\nAnswer: 12", "540", False, "12"),
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1,000", "1,000", True, "1000"),  # both sides are normalised
    ("Answer: 540 degrees", "540", True, "540"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: \\text{5 cm}", "5", True, "5"),
    ("Answer: \\textbf{(B)}", "(B)", True, "(B)"),
    ("Answer: x = 5", "5", True, "5"),
    ("Answer: x=y=7", "7", True, "7"),  # text after the last "="
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\sqrt3", "\\sqrt{3}", True, "\\sqrt{3}"),
    ("Answer: 3\\sqrt{2}", "3\\sqrt2", True, "3\\sqrt{2}"),
    ("answer: 540", "540", True, "540"),  # case-insensitive
    ("ANSWER :   540  ", "540", True, "540"),
    ("Final Answer: The final answer is $42$. I hope it is correct.", "42", True, "42"),
    ("Answer: $\\boxed{540}$", "540", True, "540"),
    ("Answer: \\$30", "30", True, "30"),
    ("Answer: 5 and 6", "5and6", True, "5and6"),
    ("Answer: 2, 3", "23", True, "23"),  # reference quirk: an all-digit list loses its commas
    ("Answer: (2, 3)", "(2,3)", True, "(2,3)"),  # not all digits: commas stay
    ("Answer: \\overline{AB}", "AB", True, "AB"),
    ("Answer:", "540", False, INVALID),  # nothing after the colon on that line
    ("no answer at all", "540", False, INVALID),
    ("", "540", False, INVALID),
]


@pytest.mark.parametrize(("response", "ground_truth", "acc", "pred"), HAND_CASES)
def test_hand_cases(response: str, ground_truth: str, acc: bool, pred: str) -> None:
    result = compute_score(response, ground_truth)
    assert result == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_only_the_last_300_characters_are_read() -> None:
    answer = "Answer: 540\n"
    inside = answer + "x" * (300 - len(answer))
    assert len(inside) == 300
    assert compute_score(inside, "540")["acc"]
    outside = answer + "x" * (301 - len(answer))
    assert compute_score(outside, "540") == {"score": -1.0, "acc": False, "pred": INVALID}


def test_window_cuts_through_the_answer_line() -> None:
    # Only "nswer: 540..." is inside the window, so no Answer: match is found.
    response = "Answer: 540" + "\n" + "y" * 289
    assert len(response) == 301
    assert compute_score(response, "540")["pred"] == INVALID


@pytest.mark.parametrize(
    ("response", "default_acc", "fallback_acc", "fallback_pred"),
    [
        ("The answer is \\boxed{540}.", False, True, "540"),
        ("The answer is \\boxed{\\frac{1}{2}}", False, False, "\\frac{1}{2}"),  # gt is "540"
        ("The answer is \\boxed{ 540}.", False, False, " 540"),  # compared verbatim
        ("\\boxed{540}" + "z" * 90, False, False, INVALID),  # box starts 101 chars from the end
        ("\\boxed{540}" + "z" * 89, False, True, "540"),  # ends exactly at the window start
        ("Answer: 12\nso \\boxed{540}", False, False, "12"),  # fallback only when Answer: is missing
        ("The answer is \\boxed{540", False, False, INVALID),  # unbalanced braces
    ],
)
def test_boxed_fallback(response: str, default_acc: bool, fallback_acc: bool, fallback_pred: str) -> None:
    assert compute_score(response, "540")["acc"] is default_acc
    result = compute_score(response, "540", boxed_fallback=True)
    assert (result["acc"], result["pred"], result["score"]) == (
        fallback_acc,
        fallback_pred,
        1.0 if fallback_acc else -1.0,
    )


def test_boxed_fallback_compares_with_the_raw_ground_truth() -> None:
    # Minerva normalises "1,000" to "1000"; the strict-box fallback does not normalise at all.
    assert compute_score("Answer: 1,000", "1,000", boxed_fallback=True)["acc"]
    assert compute_score("\\boxed{1000}", "1,000", boxed_fallback=True)["acc"] is False
    assert compute_score("\\boxed{1,000}", "1,000", boxed_fallback=True)["acc"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{5} and then \\boxed{\\frac{1}{2}} end", "\\boxed{\\frac{1}{2}}"),
        ("\\boxed{a{b}c}", "\\boxed{a{b}c}"),
        ("\\boxed{a{b}c", None),
        ("no box", None),
        ("\\boxed 5", None),
    ],
)
def test_last_boxed_only_string(text: str, expected: str | None) -> None:
    assert last_boxed_only_string(text) == expected


def test_remove_boxed() -> None:
    assert remove_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert remove_boxed("\\boxed{}") == ""
    for bad in ("\\boxed{5", "boxed{5}", "\\fbox{5}"):
        with pytest.raises(ValueError, match="boxed"):
            remove_boxed(bad)


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("an apple", "apple"),  # "an " removed before "a "
        ("\\$5.$", "5"),  # ".$" -> "$", then "\$" and "$" are dropped
        ("x \\text{and} y", "x,y"),
        ("x,\\text{and} y", "x,y"),
        ("5 \\text{and} 6", "56"),  # reference quirk: "5,6" is all digits once commas go
        ("\\mbox{7}", "7"),
        ("100 \\text{m}", "100"),  # \text{m} -> \text{} -> removed
        ("3\\mathrm{th}", "3"),
        ("1{,}000", "1000"),
        ("\\frac{1}{2}\\;", "\\frac{1}{2}"),
        ('"42"', "42"),
        ("1, 2, \\ldots, n", "1,2,,n"),
        ("text $1$ more $2$", "1"),  # only the first $...$ span is kept
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fracabc", "\\frac{a}{b}c"),
        ("\\sqrtab", "\\sqrt{a}b"),
        ("  12  ", "12"),
        ("x \\in [1, 2]", "x\\in[1,2]"),
        ("10 \\text{ square units}", "10"),
        ("5\\text{\ns}", "5"),  # the newline entries only matter for multi-line ground truths
        ("5\\text{\n}", "5"),
    ],
)
def test_normalize_final_answer_rules(raw: str, normalised: str) -> None:
    assert normalize_final_answer(raw) == normalised


def _read_jsonl(name: str) -> list[dict]:
    with real_data(name).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _perturbed(answer: str) -> str:
    return str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + "0"


def _real_ground_truths() -> list[tuple[str, str]]:
    aime = [(row["aime_id"], row["answer"]) for row in _read_jsonl("aime2024_30.jsonl")]
    dapo = [
        (f"dapo-{i}", row["reward_model"]["ground_truth"])
        for i, row in enumerate(_read_jsonl("dapo_math_17k_sample27.jsonl"))
    ]
    assert len(aime) == 30 and len(dapo) == 27
    return aime + dapo


def test_real_rows_correct_and_perturbed_answers() -> None:
    for row_id, ground_truth in _real_ground_truths():
        correct = f"{REASONING}Putting it together gives the result.\n\nAnswer: {ground_truth}"
        assert compute_score(correct, ground_truth) == {"score": 1.0, "acc": True, "pred": ground_truth}, (
            row_id
        )
        assert compute_score(f"{REASONING}Answer: ${ground_truth}$", ground_truth)["acc"], row_id
        wrong = f"{REASONING}\nAnswer: {_perturbed(ground_truth)}"
        assert compute_score(wrong, ground_truth)["score"] == -1.0, row_id
        # The answer must be on the last line the model writes: 300 characters later it is unseen.
        too_early = f"Answer: {ground_truth}\n{REASONING}"
        assert compute_score(too_early, ground_truth)["pred"] == INVALID, row_id
        boxed = f"{REASONING}So the answer is \\boxed{{{ground_truth}}}."
        assert not compute_score(boxed, ground_truth)["acc"], row_id
        assert compute_score(boxed, ground_truth, boxed_fallback=True)["acc"], row_id


def test_aime_rows_look_as_documented() -> None:
    answers = {row_id: answer for row_id, answer in _real_ground_truths() if row_id.startswith("2024-")}
    assert len(answers) == 30 and all(0 <= int(answer) <= 999 for answer in answers.values())
    assert (answers["2024-I-1"], answers["2024-I-7"], answers["2024-II-13"], answers["2024-II-15"]) == (
        "204",
        "540",
        "321",
        "315",
    )


def _check_result(result: dict) -> None:
    assert set(result) == {"score", "acc", "pred"}
    assert isinstance(result["acc"], bool) and isinstance(result["pred"], str)
    assert result["score"] == (1.0 if result["acc"] else -1.0)


# Fragments that exercise every branch of the scorer, joined in random order.
ANSWERISH = st.lists(
    st.sampled_from(
        [
            *"Answer: \n$\\{}=,.0123456789abx^_",
            "\\boxed{",
            "\\frac",
            "\\sqrt",
            "\\text{",
            "Answer:",
            "degrees",
        ]
    ),
    max_size=60,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    solution=st.one_of(st.text(max_size=400), ANSWERISH),
    ground_truth=st.one_of(st.text(max_size=20), ANSWERISH),
)
def test_never_raises_and_keys_are_consistent(solution: str, ground_truth: str) -> None:
    _check_result(compute_score(solution, ground_truth))
    _check_result(compute_score(solution, ground_truth, boxed_fallback=True))


@settings(max_examples=200, deadline=None)
@given(prefix=st.text(max_size=600), answer=st.integers(min_value=-(10**6), max_value=10**6))
def test_a_final_answer_line_with_the_ground_truth_is_always_correct(prefix: str, answer: int) -> None:
    ground_truth = str(answer)
    assert compute_score(f"{prefix}\nAnswer: {ground_truth}", ground_truth)["acc"]
    assert not compute_score(f"{prefix}\nAnswer: {answer + 1}", ground_truth)["acc"]
