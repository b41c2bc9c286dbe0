"""A user's own reward function, named by import path (``reward.function=my_pkg.my_mod:score``) or by file
(``reward.function_file=path/to/score.py reward.function_name=score``).

The function is called as verl calls a custom reward function, with keywords::

    def score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> bool | dict

and returns whether the response is correct: a ``bool``, or ``{"acc": bool, "pred": str}`` (``pred``, the
answer it read, is optional). The reward is then ``reward.correct_score`` or ``reward.wrong_score``, as for
the built-in scorer, because dynamic sampling keeps or drops a group by its accuracy. It runs in the reward
pool's worker processes with the same per-sample timeout, and an exception or a return of another type
scores the sample as wrong and counts it in ``reward/errors``. Example: :mod:`dapo_megatron.rewards.example`.

Only the names travel to the workers (a function loaded from a file cannot be pickled by reference); each
worker loads the function once.
"""

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["CustomRewardFunction", "RewardFunctionError", "as_verdict"]

_CALL_KEYWORDS = {"data_source": "", "solution_str": "", "ground_truth": ""}


class RewardFunctionError(ValueError):
    """The configured reward function cannot be loaded or called as a reward function."""


@dataclass(frozen=True)
class CustomRewardFunction:
    """A picklable handle on the user's function: ``import_path`` ("module:attribute") or ``file`` and
    ``name``. Call it as the pool's ``ScoreFn``: ``(solution, ground_truth, data_source)``."""

    import_path: str | None = None
    file: str | None = None
    name: str = "compute_score"

    @property
    def label(self) -> str:
        return self.import_path or f"{self.file}:{self.name}"

    def load(self) -> Callable[..., object]:
        """Import the function and check that it takes verl's keywords.

        Raises:
            RewardFunctionError: naming what is missing and the setting to fix.
        """
        if self.import_path is not None:
            module_name, _, attribute = self.import_path.partition(":")
            if not module_name or not attribute:
                raise RewardFunctionError(
                    f"reward.function={self.import_path!r} must be 'module:function', "
                    "e.g. my_pkg.rewards:score"
                )
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                raise RewardFunctionError(
                    f"reward.function={self.import_path}: cannot import {module_name} ({error}); install it "
                    "or put its folder on PYTHONPATH, or give the file with reward.function_file"
                ) from None  # the config error reports the cause when there is one
            setting = f"reward.function={self.import_path}"
        else:
            assert self.file is not None
            module, attribute = _module_from_file(Path(self.file)), self.name
            setting = f"reward.function_file={self.file} reward.function_name={self.name}"
        function = getattr(module, attribute, None)
        if function is None:
            public = sorted(
                name for name, value in vars(module).items() if callable(value) and name[0] != "_"
            )
            raise RewardFunctionError(
                f"{setting}: {module.__name__} has no attribute {attribute!r}; its functions: "
                f"{', '.join(public) or 'none'}"
            )
        if not callable(function):
            raise RewardFunctionError(
                f"{setting}: {attribute} is a {type(function).__name__}, not a function"
            )
        try:
            inspect.signature(function).bind(**_CALL_KEYWORDS)
        except TypeError as error:
            raise RewardFunctionError(
                f"{setting}: {attribute} cannot be called as "
                f"{attribute}(data_source=..., solution_str=..., ground_truth=...) ({error})"
            ) from None
        except ValueError:  # no signature to inspect (a builtin): the call itself will tell
            pass
        return function

    def __call__(self, solution: str, ground_truth: str, data_source: str) -> Mapping[str, object]:
        output = _loaded(self)(data_source=data_source, solution_str=solution, ground_truth=ground_truth)
        return as_verdict(output, f"reward function {self.label}")


def as_verdict(output: object, source: str) -> Mapping[str, object]:
    """A user's verdict (a function's return, a service's reply) as the pool's ``{"acc": ..., "pred": ...}``:
    a bool becomes ``{"acc": output, "pred": ""}``, a mapping passes (the pool checks its types, as for the
    built-in scorer's).

    Raises:
        TypeError: for anything else, naming `source` ("reward function m:f") and the contract.
    """
    if isinstance(output, bool):
        return {"acc": output, "pred": ""}
    if isinstance(output, Mapping):
        return output
    raise TypeError(
        f"{source} returned {output!r:.100} of type {type(output).__name__}; return a bool or "
        "{'acc': bool, 'pred': str} (the rewards are reward.correct_score / reward.wrong_score)"
    )


_LOADED: dict[CustomRewardFunction, Callable[..., object]] = {}


def _loaded(handle: CustomRewardFunction) -> Callable[..., object]:
    if handle not in _LOADED:
        _LOADED[handle] = handle.load()
    return _LOADED[handle]


def _module_from_file(path: Path) -> ModuleType:
    if path.suffix != ".py" or not path.is_file():
        raise RewardFunctionError(
            f"reward.function_file={path}: {'no such file' if not path.exists() else 'not a .py file'} "
            f"(relative paths start at {Path.cwd()})"
        )
    resolved = path.resolve()
    # Registered under a name of its own so that pickling and dataclasses inside the file find the module.
    name = f"dapo_reward_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise RewardFunctionError(
            f"reward.function_file={path}: importing it failed: {type(error).__name__}: {error}"
        ) from None
    return module
