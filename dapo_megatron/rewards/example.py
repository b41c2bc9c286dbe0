"""An example of a user's reward function (see :mod:`dapo_megatron.rewards.custom` for the contract).

Grades a response by the last number in it, as GSM8K-style tasks are often graded::

    python -m dapo_megatron.train reward.function=dapo_megatron.rewards.example:last_number_matches ...
    python -m dapo_megatron.train reward=last_number ...   # the same, as a config (configs/reward/)

or, from a file of your own with the same function in it::

    python -m dapo_megatron.train reward.function_file=my_reward.py reward.function_name=last_number_matches
"""

import re

__all__ = ["last_number_matches"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_matches(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, object]:
    """Correct when the last number in ``solution_str`` equals ``ground_truth`` as a number (``1,000`` and
    ``1000.0`` both match ``1000``)."""
    numbers = _NUMBER.findall(solution_str)
    if not numbers:
        return {"acc": False, "pred": ""}
    pred = numbers[-1].replace(",", "")
    try:
        acc = float(pred) == float(ground_truth.replace(",", ""))
    except ValueError:  # a ground truth that is not a number cannot be matched by one
        acc = False
    return {"acc": acc, "pred": pred}
