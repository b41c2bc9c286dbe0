"""DAPO's rule-based math scorer (arXiv 2503.14476, Eq. 7), re-implemented from its documented rules.

The reference is ``math_dapo.compute_score`` in the DAPO repository (``eval/math_dapo.py``), which is
identical to verl's ``verl/utils/reward_score/math_dapo.py`` at the commit used for the DAPO
reproduction. It is a Minerva-style check:

1. keep only the last 300 characters of the response;
2. take the last ``Answer: ...`` line (case-insensitive), or the sentinel ``"[INVALID]"``;
3. normalise prediction and ground truth with :func:`normalize_final_answer`;
4. the answer is correct iff the two strings are identical (no numeric equivalence: ``0540`` is not
   ``540`` and ``\\frac{1}{2}`` is not ``0.5``).

The reward is +1 for a correct answer and -1 otherwise.

verl 0.9.1 added a fallback that DAPO never used: when no ``Answer:`` line is found, the last
``\\boxed{...}`` in the final 100 characters is compared verbatim with the ground truth. It is off by
default here and enabled with ``boxed_fallback=True``.
"""

import re

__all__ = [
    "INVALID",
    "compute_score",
    "last_boxed_only_string",
    "normalize_final_answer",
    "remove_boxed",
]

INVALID = "[INVALID]"
"""Prediction reported when the response contains no extractable answer."""

# DAPO scores only the tail of the response: the prompt asks for the answer on the last line, and
# the bound keeps scoring cheap for 20k-token responses.
_MINERVA_WINDOW = 300
_BOXED_WINDOW = 100  # verl 0.9.1's strict-box window, applied inside the 300-character tail
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BOX_OPEN = "\\boxed{"

# Replacement pairs, applied in this order. Order matters: "an " must go before "a ", and "\ " (a
# LaTeX space) before plain spaces, exactly as in the reference.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Units, filler words and LaTeX decorations deleted verbatim, in this order. The list is the
# reference's, including its quirks: "sue" and "childrentickets" come from MATH answers, and two
# entries contain a real newline after "\text{".
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# (pattern, replacement) pairs applied with re.sub in order. Without DOTALL, "." stops at newlines,
# which only matters for multi-line ground truths; the reference behaves the same way.
_REGEX_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), r"$\2$"),  # keep only the first $...$ span
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last closing brace
    # Brace-less TeX shorthand: \frac12 -> \frac{1}{2}, \fracabc -> \frac{a}{b}c, \sqrt3 -> \sqrt{3}.
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def normalize_final_answer(final_answer: str) -> str:
    """Normalise an answer string the way DAPO's scorer does.

    Steps, in order: keep the text after the last ``=``; apply the substitutions; delete units and
    decorations; keep the first ``$...$`` span; unwrap ``\\text``, ``\\textbf``, ``\\overline`` and
    ``\\boxed``; expand ``\\frac12``/``\\sqrt3`` shorthand; drop ``$``; drop thousands commas from
    pure digit strings; strip surrounding whitespace.
    """
    answer = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    for pattern, replacement in _REGEX_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    # str.isdigit (not a regex) on purpose: it also accepts other Unicode digits, like the reference.
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_only_string(text: str) -> str | None:
    """Return the last ``\\boxed{...}`` in ``text`` including its balanced braces, or None.

    Returns None when there is no ``\\boxed{`` or its braces never close.
    """
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for position in range(start + len(_BOX_OPEN) - 1, len(text)):
        character = text[position]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """Return the content of a string of the exact form ``\\boxed{content}``.

    Raises:
        ValueError: if ``boxed`` does not start with ``\\boxed{`` and end with ``}``.
    """
    # A ValueError rather than the reference's assert, so the check survives ``python -O``.
    if not (boxed.startswith(_BOX_OPEN) and boxed.endswith("}")):
        raise ValueError(f"expected a string of the form \\boxed{{...}}; got {boxed!r}")
    return boxed[len(_BOX_OPEN) : -1]


def _minerva_prediction(tail: str) -> str:
    matches = _ANSWER_LINE.findall(tail)
    return normalize_final_answer(matches[-1] if matches else INVALID)


def compute_score(solution_str: str, ground_truth: str, *, boxed_fallback: bool = False) -> dict:
    """Score one response against its ground truth with DAPO's rules.

    Args:
        solution_str: the decoded response (prompt excluded).
        ground_truth: the reference answer, e.g. ``"540"``.
        boxed_fallback: when no ``Answer:`` line is found, compare the content of the last
            ``\\boxed{...}`` in the final 100 characters verbatim with the raw ground truth
            (verl 0.9.1 behaviour; not part of DAPO).

    Returns:
        ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}`` where ``pred`` is the normalised
        ``Answer:`` text, ``"[INVALID]"``, or (with the fallback) the raw boxed content.
    """
    tail = solution_str[-_MINERVA_WINDOW:]
    pred = _minerva_prediction(tail)
    correct = pred == normalize_final_answer(ground_truth)
    # verl triggers the fallback on the normalised prediction being the sentinel, so a response
    # that literally ends with "Answer: [INVALID]" also falls back; keep that for parity.
    if boxed_fallback and pred == INVALID:
        boxed = last_boxed_only_string(tail[-_BOXED_WINDOW:])
        if boxed is not None:
            pred = remove_boxed(boxed)
            correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
