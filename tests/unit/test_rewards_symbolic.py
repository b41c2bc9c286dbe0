"""Safe symbolic equivalence: what it accepts, what it rejects, and that model text never runs as code."""

import builtins
import signal
import time
import uuid
from pathlib import Path

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.rewards.symbolic import AnswerParseError, is_equivalent, parse_answer


@pytest.mark.parametrize(
    ("pred", "ground_truth"),
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\frac12", "0.5"),
        ("\\dfrac{3}{6}", "1/2"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("$\\frac{1}{2}$", ".5"),
        ("0540", "540"),
        ("1,000", "1000"),
        ("1,234,567.5", "1234567.5"),
        ("50\\%", "50"),
        ("30^\\circ", "30"),
        ("3.0", "3"),
        ("-2^2", "-4"),
        ("2^{10}", "1024"),
        ("x = 5", "5"),
        ("\\text{5}", "5"),
        ("\\frac{\\sqrt2}{2}", "\\sqrt{2}/2"),
        ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\frac{1}{1+\\sqrt{2}}", "\\sqrt{2}-1"),  # only equal after rationalising: numeric check
        ("\\sqrt[3]{8}", "2"),
        ("2\\sqrt{3}", "\\sqrt{12}"),
        ("2\\pi", "\\pi \\cdot 2"),
        ("3 \\times 4", "12"),
        ("(x+1)^2", "x^2+2x+1"),
        ("\\dfrac{x^2-1}{x-1}", "x+1"),
        ("x^23", "3x^2"),  # TeX: ^ takes one character
        ("\\left(3, \\frac{1}{2}\\right)", "(3, 0.5)"),
        ("[1, 2]", "(1, 2)"),
        ("\\{2, 1\\}", "\\{1, 2\\}"),
        ("1, 2", "\\{2, 1\\}"),
        ("\\text{(B)}", "\\text{(B)}"),  # identical strings match even when they do not parse
    ],
)
def test_equivalent(pred: str, ground_truth: str) -> None:
    assert is_equivalent(pred, ground_truth)
    assert is_equivalent(ground_truth, pred)


@pytest.mark.parametrize(
    ("pred", "ground_truth"),
    [
        ("541", "540"),
        ("0.333", "\\frac13"),  # no rounding leniency
        ("0.7071", "\\frac{\\sqrt2}{2}"),
        ("10^{100}+1", "10^{100}"),  # exact for rationals, however large
        ("(1, 2)", "(2, 1)"),  # tuples are ordered
        ("(1, 2)", "\\{1, 2\\}"),
        ("1, 2", "1, 2, 3"),
        ("\\sqrt{x^2}", "x"),
        ("2^x", "2^y"),
        ("x", "5"),
        ("1 000", "1000"),  # ambiguous grouping is refused, not read as 1*000
        ("5 \\text{cm}", "5"),  # units are not understood
        ("\\frac{1}{0}", "1"),
        ("", "0"),
        ("\\sin x", "\\sin x + 0"),  # unsupported command
    ],
)
def test_not_equivalent(pred: str, ground_truth: str) -> None:
    assert not is_equivalent(pred, ground_truth)
    assert not is_equivalent(ground_truth, pred)


def test_parse_answer_builds_exact_sympy_objects() -> None:
    assert parse_answer("0.1") == sympy.Rational(1, 10)
    assert parse_answer("1,000") == 1000
    assert parse_answer("(1, x)") == sympy.Tuple(1, sympy.Symbol("x"))
    assert parse_answer("\\{3, 1\\}") == sympy.FiniteSet(1, 3)
    assert parse_answer("\\frac123") == sympy.Rational(3, 2)  # \frac{1}{2}3


@pytest.mark.parametrize(
    "text",
    [
        "\\frac{1}{0}",
        "0^{-1}",
        "9^{9^{9}}",
        "10^{100000}",
        "(x+1)^{1000}",
        "(1, 2) + 1",
        "x^2^3",
        "\\sqrt[x]{8}",
        "(" * 60 + "1" + ")" * 60,
        "1" * 600,
        "\\boxed{1",
        "a_1",
        "f(x)'",
    ],
)
def test_parse_answer_rejects(text: str) -> None:
    with pytest.raises(AnswerParseError):
        parse_answer(text)


def test_huge_answers_are_rejected_quickly() -> None:
    start = time.monotonic()
    for text in ("9^{9^{9^{9}}}", "2^{10000}^{10000}", "(10^{1000})^{1000}", "1" * 10_000):
        assert not is_equivalent(text, "1")
    assert time.monotonic() - start < 2.0


def _malicious_answers(marker_file: Path) -> list[str]:
    command = f"touch {marker_file}"
    return [
        f"__import__('os').system('{command}')",
        f'__import__("os").system("{command}")',
        f"().__class__.__bases__[0].__subclasses__()[0]('{command}')",
        "().__class__.__bases__[0].__subclasses__()",
        f"(lambda: __import__('os').system('{command}'))()",
        f"eval(\"__import__('os').system('{command}')\")",
        f"exec(\"import os; os.system('{command}')\")",
        f"\\frac{{__import__('os').system('{command}')}}{{2}}",
        f"\\boxed{{__import__('os').system('{command}')}}",
        f"x = __import__('os').system('{command}')",
        f"Symbol('x') + __import__('os').system('{command}')",
        f"1 + 1; import os; os.system('{command}')",
    ]


def test_model_text_is_never_run_as_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker_file = tmp_path / f"pwned_{uuid.uuid4().hex}"
    # sympy calls eval/exec on its own constant strings (code generation, unit tables); none of
    # those may ever contain text taken from the answer.
    seen: list[str] = []
    real_eval, real_exec = builtins.eval, builtins.exec

    def spy_eval(source, *args, **kwargs):
        seen.append(str(source))
        return real_eval(source, *args, **kwargs)

    def spy_exec(source, *args, **kwargs):
        seen.append(str(source))
        return real_exec(source, *args, **kwargs)

    monkeypatch.setattr(builtins, "eval", spy_eval)
    monkeypatch.setattr(builtins, "exec", spy_exec)
    for answer in _malicious_answers(marker_file):
        assert is_equivalent(answer, "5") is False
        assert is_equivalent("5", answer) is False
        assert is_equivalent(answer, "0") is False
    assert not marker_file.exists()
    assert not any(marker_file.name in source or "__import__" in source for source in seen)


def test_timeout_gives_false_and_restores_the_alarm() -> None:
    assert is_equivalent("(x+1)^2", "x^2+2x+1", timeout_s=None)
    assert not is_equivalent("(x+1)^2", "x^2+2x+1", timeout_s=1e-6)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_someone_elses_alarm_handler_is_left_alone() -> None:
    def handler(signum, frame) -> None:
        raise AssertionError("must not fire")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        # With a foreign handler installed no timer is armed, so even a tiny budget does not cut in.
        assert is_equivalent("(x+1)^2", "x^2+2x+1", timeout_s=1e-6)
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.signal(signal.SIGALRM, previous)


LATEXISH = st.lists(
    st.sampled_from([*"0123456789x+-*/^()[]{},. =%$", "\\frac", "\\sqrt", "\\pi", "\\{", "\\}", "\\cdot"]),
    max_size=25,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(pred=st.one_of(LATEXISH, st.text(max_size=40)), ground_truth=st.one_of(LATEXISH, st.text(max_size=10)))
def test_never_raises(pred: str, ground_truth: str) -> None:
    assert isinstance(is_equivalent(pred, ground_truth, timeout_s=2.0), bool)


UNRELATED_GROUND_TRUTHS = ["540", "3", "\\frac{1}{2}", "-7", "2\\sqrt{3}", "0", "\\pi", "10^{400}"]
IRRATIONALS = [
    "\\sqrt{2}",
    "\\pi",
    "\\sqrt[3]{5}",
    "\\sqrt{\\sqrt{2}+1}",
    "\\sqrt{-3}",
    "(\\sqrt{2}-\\sqrt{3})",
]


@st.composite
def hostile_scalars(draw: st.DrawFn) -> str:
    """Values whose float evaluation overflows, underflows or loses every digit to cancellation."""
    exponent = draw(st.integers(300, 9_000))
    irrational = draw(st.sampled_from(IRRATIONALS))
    forms = [
        f"10^{{{exponent}}}{irrational}",  # overflows a float: inf <= tol * inf
        f"-10^{{{exponent}}}{irrational}",
        f"10^{{-{exponent}}}{irrational}",  # underflows to 0.0
        f"\\frac{{{irrational}}}{{10^{{{exponent}}}}}",
        f"10^{{{exponent}}}{irrational} - 10^{{{exponent}}}\\sqrt{{2}}\\pi",  # inf - inf = nan
        f"\\sqrt{{\\sqrt{{\\sqrt{{10^{{{exponent}}}{irrational}}}}}}}",
        f"{irrational}^{{{draw(st.integers(-9_999, 9_999).filter(lambda e: abs(e) > 1_000))}}}",
    ]
    return draw(st.sampled_from(forms))


@pytest.mark.parametrize("hostile", ["10^{400}\\sqrt{2}", "10^{400}\\pi", "10^{-400}\\sqrt{2}"])
@pytest.mark.parametrize("ground_truth", ["540", "3", "\\frac{1}{2}", "-7", "2\\sqrt{3}", "0"])
def test_overflowing_or_underflowing_answer_matches_nothing(hostile: str, ground_truth: str) -> None:
    assert not is_equivalent(hostile, ground_truth)
    assert not is_equivalent(f"({hostile}, {hostile})", f"({ground_truth}, 1)")


@settings(max_examples=120, deadline=None)
@given(
    hostile=hostile_scalars(), other=hostile_scalars(), ground_truth=st.sampled_from(UNRELATED_GROUND_TRUTHS)
)
def test_hostile_values_never_equal_an_unrelated_ground_truth(
    hostile: str, other: str, ground_truth: str
) -> None:
    assert not is_equivalent(hostile, ground_truth, timeout_s=5.0)
    assert not is_equivalent(f"({hostile}, {other})", f"({ground_truth}, 2)", timeout_s=5.0)


# Zero in irrational forms that strict evaluation cannot tell from zero at sympy's maximum precision.
HIDDEN_ZEROS = ["\\frac{1}{1+\\sqrt{2}}-\\sqrt{2}+1", "\\sqrt{2}+\\sqrt{3}-\\sqrt{5+2\\sqrt{6}}"]


@pytest.mark.parametrize("zero", HIDDEN_ZEROS)
@pytest.mark.parametrize("ground_truth", ["540", "7", "\\frac{1}{2}", "(1, 2)", "x+1", "-3", "2\\sqrt{3}"])
def test_a_zero_scaled_past_every_precision_matches_no_ground_truth(zero: str, ground_truth: str) -> None:
    """An undecided comparison is not an equality: 10^{400} times an exact zero, plus the ground truth's
    opposite, used to exhaust sympy's precision and count as equal to anything."""
    hostile = f"10^{{400}}({zero})"
    assert not is_equivalent(hostile, ground_truth)
    assert not is_equivalent(ground_truth, hostile)
    assert is_equivalent(hostile, "0")  # it is zero, exactly


@pytest.mark.parametrize(
    ("pred", "ground_truth"),
    [("\\frac{1}{1+\\sqrt{2}}", "\\sqrt{2}-1"), ("\\sqrt{5+2\\sqrt{6}}", "\\sqrt{2}+\\sqrt{3}")],
)
def test_equal_irrational_forms_still_match(pred: str, ground_truth: str) -> None:
    assert is_equivalent(pred, ground_truth) and is_equivalent(ground_truth, pred)
