"""Optional symbolic equivalence of math answers (``0.5`` = ``\\frac{1}{2}``, ``(x+1)^2`` = ``x^2+2x+1``).

DAPO itself compares normalised strings only (see :mod:`dapo_megatron.rewards.math_dapo`); this
module is a more lenient check for other data sets (GSM8K, MATH) and for ablations.

Model output is untrusted text. sympy's ``sympify``/``parse_expr`` run ``eval`` on their input, so
they are never used here. Instead a small recursive-descent parser accepts a whitelisted subset of
LaTeX and builds sympy objects through their constructors:

* numbers: integers, decimals (parsed exactly: ``0.5`` is ``1/2``), thousands separators
  (``1,000``), a leading sign; ``%`` and degree marks are dropped (``50\\%`` = ``50``);
* ``+ - * / ^``, ``\\cdot``, ``\\times``, ``\\div``, implicit products (``2\\sqrt{3}``, ``3x``);
* ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac`` and the brace-less ``\\frac12``), ``\\sqrt{x}``,
  ``\\sqrt[n]{x}``, ``\\sqrt2``, ``\\pi``, single-letter variables;
* ``( )``, ``[ ]`` and ``{ }`` for grouping; ``(a, b)`` and ``[a, b]`` are ordered tuples,
  ``\\{a, b\\}`` and a bare ``a, b`` are sets;
* ``\\boxed{}``, ``\\text{}``, ``\\mathrm{}``, ``\\textbf{}`` are unwrapped, ``$`` and LaTeX spacing
  dropped, and a leading ``x =`` removed.

Anything else (other commands, functions, identifiers longer than one letter, quotes, underscores)
fails to parse, and an answer that fails to parse is equivalent only to an identical string.
Thousands separators make ``1,000`` one number; write ``1, 000`` for a list of two.

Size guards (input length, nesting depth, exponent size) keep sympy's work bounded; the remaining
cost is capped by ``timeout_s`` where a timer can be used (see :func:`is_equivalent`).
"""

import contextlib
import re
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sympy is imported lazily: importing the rewards package must stay cheap.
    import sympy

__all__ = ["AnswerParseError", "is_equivalent", "parse_answer"]

_MAX_CHARS = 512
_MAX_DEPTH = 48
_MAX_EXPONENT_NUMERATOR = 10_000
_MAX_EXPONENT_DENOMINATOR = 64
_MAX_POWER_BITS = 100_000  # bit length allowed for an exact rational power like 10^{100}^{...}
_MAX_SYMBOLIC_EXPONENT = 32  # (x+1)^{1000} would make expand/simplify explode
_EVAL_DIGITS = 30  # significant digits that must be found for a difference to count as nonzero


class AnswerParseError(ValueError):
    """The answer is outside the supported LaTeX subset (or too large to handle safely)."""


class _SymbolicTimeout(BaseException):
    # A BaseException so that sympy's internal ``except Exception`` blocks cannot swallow it.
    pass


# Pure string rewrites done before tokenising, in order.
_PLAIN_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("\\left", ""),
    ("\\right", ""),
    ("\\displaystyle", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\cdot", "*"),
    ("\\times", "*"),
    ("\\div", "/"),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("°", ""),
    ("\\%", ""),
    ("%", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\ ", ""),
    ("$", ""),
    ("−", "-"),  # U+2212 MINUS SIGN
    ("π", "\\pi"),
)
_WRAPPER_OPEN = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{")
_LEADING_ASSIGNMENT = re.compile(r"^\s*[A-Za-z]\s*=(?!=)")

_TOKEN = re.compile(
    r"""
    (?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d*)?|\.\d+)
    |(?P<set_brace>\\[{}])
    |(?P<command>\\[A-Za-z]+)
    |(?P<letter>[A-Za-z])
    |(?P<operator>[-+*/^(),\[\]{}])
    |(?P<space>\s+)
    """,
    re.VERBOSE,
)
_CLOSING = {"(": ")", "[": "]", "{": "}", "\\{": "\\}"}


def _preprocess(text: str) -> str:
    for before, after in _PLAIN_REPLACEMENTS:
        text = text.replace(before, after)
    # Each pass removes one wrapper (brace-matched, so \boxed{\frac{1}{2}} works), so this ends.
    while (match := _WRAPPER_OPEN.search(text)) is not None:
        depth = 0
        for close in range(match.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[close], 0)
            if depth == 0:
                break
        else:
            raise AnswerParseError("unbalanced braces")
        text = text[: match.start()] + text[match.end() : close] + text[close + 1 :]
    return _LEADING_ASSIGNMENT.sub("", text).strip()


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise AnswerParseError(f"unsupported character {text[position]!r}")
        kind = match.lastgroup
        assert kind is not None  # every alternative is a named group
        if kind == "number" and tokens and tokens[-1][0] == "number":
            # "1 000" or "1.5.5": refuse to guess (a product would turn "1 000" into 0).
            raise AnswerParseError("two numbers in a row")
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


class _Parser:
    """Recursive descent over the token list; every node is built with a sympy constructor.

    Grammar (``implicit`` is juxtaposition, as in ``2\\sqrt{3}`` or ``3x``)::

        answer     := list
        list       := expression ("," expression)*
        expression := term (("+" | "-") term)*
        term       := unary (("*" | "/") unary | implicit power)*
        unary      := ("+" | "-") unary | power
        power      := atom ("^" (group | ["+" | "-"] single))?
        atom       := number | letter | \\pi | \\frac arg arg | \\sqrt ["[" expression "]"] arg
                    | "(" list ")" | "[" list "]" | "{" list "}" | "\\{" list "\\}"
        arg        := group | single;  group := "{" expression "}";  single := one character
    """

    def __init__(self, tokens: list[tuple[str, str]], sympy_module) -> None:
        self._tokens = tokens
        self._position = 0
        self._depth = 0
        self._sp = sympy_module

    def parse(self) -> "sympy.Basic":
        items = self._list()
        if self._position != len(self._tokens):
            raise AnswerParseError(f"unexpected {self._tokens[self._position][1]!r}")
        return items[0] if len(items) == 1 else self._sp.FiniteSet(*items)

    # -- token helpers -------------------------------------------------------------------
    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._position] if self._position < len(self._tokens) else None

    def _peek_text(self) -> str | None:
        token = self._peek()
        return None if token is None else token[1]

    def _next(self) -> tuple[str, str]:
        token = self._peek()
        if token is None:
            raise AnswerParseError("unexpected end of answer")
        self._position += 1
        return token

    def _expect(self, text: str) -> None:
        _, found = self._next()
        if found != text:
            raise AnswerParseError(f"expected {text!r}, found {found!r}")

    def _scalar(self, value: "sympy.Basic") -> "sympy.Expr":
        # Tuples and sets only appear as whole answers; arithmetic on them is not an answer.
        if not isinstance(value, self._sp.Expr):
            raise AnswerParseError("tuples and sets cannot take part in arithmetic")
        return value

    # -- grammar -------------------------------------------------------------------------
    def _list(self) -> list["sympy.Basic"]:
        items = [self._expression()]
        while self._peek_text() == ",":
            self._next()
            items.append(self._expression())
        return items

    def _expression(self) -> "sympy.Basic":
        self._depth += 1
        if self._depth > _MAX_DEPTH:
            raise AnswerParseError("answer is nested too deeply")
        value = self._term()
        while self._peek_text() in ("+", "-"):
            operator = self._next()[1]
            right = self._scalar(self._term())
            value = self._scalar(value) + right if operator == "+" else self._scalar(value) - right
        self._depth -= 1
        return value

    def _term(self) -> "sympy.Basic":
        value = self._unary()
        while True:
            text = self._peek_text()
            if text in ("*", "/"):
                self._next()
                right = self._scalar(self._unary())
                value = self._scalar(value) * right if text == "*" else self._divide(value, right)
            elif self._starts_implicit_factor():
                value = self._scalar(value) * self._scalar(self._power())
            else:
                return value

    def _starts_implicit_factor(self) -> bool:
        token = self._peek()
        if token is None:
            return False
        kind, text = token
        return kind in ("number", "letter", "command") or text in ("(", "{")

    def _unary(self) -> "sympy.Basic":
        if self._peek_text() in ("+", "-"):
            negative = self._next()[1] == "-"
            value = self._scalar(self._unary())
            return -value if negative else value
        return self._power()

    def _power(self) -> "sympy.Basic":
        base = self._atom()
        if self._peek_text() != "^":
            return base
        self._next()
        if self._peek_text() == "{":
            exponent = self._group()
        elif self._peek_text() in ("+", "-"):  # x^-1: not valid TeX, but common in answers
            negative = self._next()[1] == "-"
            exponent = self._single()
            exponent = -exponent if negative else exponent
        else:
            exponent = self._single()
        if self._peek_text() == "^":
            raise AnswerParseError("double superscript")
        return self._safe_power(self._scalar(base), self._scalar(exponent))

    def _atom(self) -> "sympy.Basic":
        kind, text = self._next()
        sp = self._sp
        if kind == "number":
            return _exact_number(text, sp)
        if kind == "letter":
            return sp.Symbol(text)
        if text == "\\pi":
            return sp.pi
        if text == "\\frac":
            numerator = self._argument()
            return self._divide(numerator, self._argument())
        if text == "\\sqrt":
            return self._root()
        if text in _CLOSING:
            items = self._list()
            self._expect(_CLOSING[text])
            if len(items) == 1 and text != "\\{":
                return items[0]
            return sp.FiniteSet(*items) if text in ("{", "\\{") else sp.Tuple(*items)
        raise AnswerParseError(f"unsupported token {text!r}")

    def _group(self) -> "sympy.Basic":
        self._expect("{")
        value = self._expression()
        self._expect("}")
        return value

    def _argument(self) -> "sympy.Basic":
        """A TeX macro argument: a braced group or a single character (``\\frac12``)."""
        return self._group() if self._peek_text() == "{" else self._single()

    def _single(self) -> "sympy.Basic":
        token = self._peek()
        if token is not None and token[0] == "number" and len(token[1]) > 1:
            # TeX takes one character: \frac123 is \frac{1}{2}3 and x^23 is x^{2}3. Split the
            # number token and put the rest back.
            first, rest = token[1][0], token[1][1:]
            if not first.isdigit():
                raise AnswerParseError(f"unsupported argument {token[1]!r}")
            self._tokens[self._position : self._position + 1] = [("number", first), *_tokenize(rest)]
        kind, text = self._peek() or ("", "")
        if kind in ("number", "letter") or text == "\\pi":
            return self._atom()
        raise AnswerParseError(f"unsupported argument {text!r}")

    def _root(self) -> "sympy.Basic":
        sp = self._sp
        index = None
        if self._peek_text() == "[":
            self._next()
            index = self._expression()
            self._expect("]")
            if not (index.is_Integer and 2 <= index <= _MAX_EXPONENT_DENOMINATOR):
                raise AnswerParseError("root index must be a small integer")
        radicand = self._scalar(self._argument())
        return sp.sqrt(radicand) if index is None else sp.root(radicand, index)

    def _divide(self, numerator: "sympy.Basic", denominator: "sympy.Basic") -> "sympy.Expr":
        if self._scalar(denominator).is_zero:
            raise AnswerParseError("division by zero")
        return self._scalar(numerator) / denominator

    def _safe_power(self, base: "sympy.Expr", exponent: "sympy.Expr") -> "sympy.Expr":
        # sympy evaluates numeric powers eagerly, so the size check must happen before Pow().
        if exponent.is_Rational:
            if abs(exponent.p) > _MAX_EXPONENT_NUMERATOR or exponent.q > _MAX_EXPONENT_DENOMINATOR:
                raise AnswerParseError("exponent too large")
            if base.free_symbols and abs(exponent.p) > _MAX_SYMBOLIC_EXPONENT:
                raise AnswerParseError("exponent too large for a symbolic base")
            if base.is_Rational:
                bits = max(abs(base.p).bit_length(), base.q.bit_length()) * abs(exponent.p)
                if bits > _MAX_POWER_BITS:
                    raise AnswerParseError("power too large")
            if base.is_zero and exponent.is_negative:
                raise AnswerParseError("division by zero")
        return self._sp.Pow(base, exponent)


def _exact_number(text: str, sp) -> "sympy.Rational":
    # Built from Python ints so "0.1" is exactly 1/10 (no binary float on the way).
    whole, _, fraction = text.replace(",", "").partition(".")
    digits = int((whole or "0") + fraction)
    return sp.Rational(digits, 10 ** len(fraction))


def parse_answer(text: str) -> "sympy.Basic":
    """Parse an answer in the supported LaTeX subset into a sympy object without evaluating code.

    Returns a sympy expression, a ``Tuple`` (ordered) or a ``FiniteSet`` (unordered).

    Raises:
        AnswerParseError: if the text is too long, uses unsupported syntax or is too large.
    """
    import sympy

    if len(text) > _MAX_CHARS:
        raise AnswerParseError(f"answer longer than {_MAX_CHARS} characters")
    tokens = _tokenize(_preprocess(text))
    if not tokens:
        raise AnswerParseError("empty answer")
    value = _Parser(tokens, sympy).parse()
    if value.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        raise AnswerParseError("answer is not finite")
    return value


def _equal(left: "sympy.Basic", right: "sympy.Basic") -> bool:
    import sympy

    if isinstance(left, sympy.Tuple) or isinstance(right, sympy.Tuple):
        return (
            isinstance(left, sympy.Tuple)
            and isinstance(right, sympy.Tuple)
            and len(left) == len(right)
            and all(_equal(a, b) for a, b in zip(left, right, strict=True))
        )
    if isinstance(left, sympy.FiniteSet) or isinstance(right, sympy.FiniteSet):
        if not (isinstance(left, sympy.FiniteSet) and isinstance(right, sympy.FiniteSet)):
            return False
        unmatched = list(right)
        for element in left:
            match = next((other for other in unmatched if _equal(element, other)), None)
            if match is None:
                return False
            unmatched.remove(match)
        return not unmatched
    return _scalar_equal(left, right)


def _scalar_equal(left: "sympy.Expr", right: "sympy.Expr") -> bool:
    import sympy

    difference = left - right
    if difference == 0:
        return True
    if difference.free_symbols:
        return sympy.cancel(difference) == 0 or sympy.simplify(difference) == 0
    # Exact rationals that differ are different; only irrational forms need a numeric check
    # (1/(1+\sqrt2) versus \sqrt2-1 stays unsimplified after construction).
    if difference.is_Rational:
        return False
    try:
        # Strict evaluation either yields the difference to _EVAL_DIGITS correct digits, which
        # proves it nonzero however small (10^{-400}\sqrt2) or large (10^{400}\sqrt2, which
        # overflows a float), or fails to tell it from zero at sympy's maximum precision.
        value = difference.evalf(_EVAL_DIGITS, strict=True)
    except sympy.core.evalf.PrecisionExhausted:
        return _exactly_zero(difference)
    return bool(value.is_finite) and value == 0


def _exactly_zero(difference: "sympy.Expr") -> bool:
    r"""Whether a difference that strict evaluation cannot tell from zero simplifies to exactly 0.

    Two kinds exhaust sympy's precision: an exact zero in irrational form (1/(1+\sqrt2) - (\sqrt2-1),
    \sqrt2+\sqrt3 - \sqrt{5+2\sqrt6}) and a nonzero value behind a huge term that cancels to zero
    (10^{400}(1/(1+\sqrt2) - \sqrt2 + 1) - 540). Rationalised denominators and denested roots settle both
    kinds; what they leave undecided is not an equality, or one such answer would match every ground truth."""
    import sympy

    rationalised = sympy.radsimp(difference)
    return rationalised == 0 or sympy.sqrtdenest(rationalised) == 0


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise _SymbolicTimeout after ``seconds`` using SIGALRM, where that is possible and free.

    A timer is used only on the main thread of a POSIX process, with no SIGALRM handler or timer of
    someone else's in place; otherwise the block runs without a limit (the reward pool's per-sample
    timeout still applies when scoring runs in its workers).
    """
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )
    if not usable:
        yield
        return

    def _on_alarm(signum, frame) -> None:
        raise _SymbolicTimeout

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    # Two levels so the handler is restored even when the one-shot alarm fires inside the inner
    # ``finally`` (before the timer is cancelled); it cannot fire a second time.
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def is_equivalent(pred: str, ground_truth: str, *, timeout_s: float | None = 5.0) -> bool:
    """Whether ``pred`` and ``ground_truth`` denote the same value, tuple or set.

    Identical strings (after stripping whitespace) are equivalent even when they do not parse, so
    answers like ``\\text{(B)}`` still match. Otherwise both must parse (see the module docstring)
    and compare equal: exactly for rationals and polynomial/rational expressions, by ``simplify``
    for other symbolic forms, and for irrational constants by evaluating the difference: equal
    only when sympy cannot tell it from zero at its maximum precision (a difference whose first
    30 digits it can compute is nonzero, however large or small). Unparseable input, sympy errors and timeouts
    give False; this function never raises on any input text.

    Args:
        pred: the model's answer (untrusted).
        ground_truth: the reference answer.
        timeout_s: wall-clock cap for parsing and comparing, enforced with SIGALRM on the main
            thread of POSIX processes only; None disables it.
    """
    if pred.strip() == ground_truth.strip():
        return True
    try:
        with _time_limit(timeout_s):
            return _equal(parse_answer(pred), parse_answer(ground_truth))
    except _SymbolicTimeout:
        return False
    except Exception:  # AnswerParseError, and sympy's many error types on odd but valid input
        return False
