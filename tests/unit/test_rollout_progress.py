"""The rollout progress display: a bar on a terminal that leaves no line behind, periodic lines in a log."""

from __future__ import annotations

import io

import pytest

from dapo_megatron.rollout import client
from dapo_megatron.rollout.client import _Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_that_is_erased_at_the_end() -> None:
    terminal = Terminal()
    progress = _Progress(12, stream=terminal)
    progress.update(8)
    progress.update(4)
    assert progress.samples == 12
    progress.close()
    shown = terminal.getvalue()
    assert shown.startswith("\rrollout:") and "/12 [" in shown
    assert shown.endswith(" \r") and "\n" not in shown  # overwritten with blanks: the step line stays alone


def test_a_log_gets_a_line_per_interval_and_nothing_for_a_short_rollout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = io.StringIO()
    short = _Progress(None, stream=log)
    short.update(16)
    short.close()
    assert log.getvalue() == ""  # the step line says enough

    monkeypatch.setattr(client, "_PROGRESS_LOG_EVERY_S", 0.0)
    slow = _Progress(None, stream=log)
    slow.update(16)
    slow.update(16)
    slow.close()
    lines = log.getvalue().splitlines()
    assert [line.split(" samples")[0] for line in lines] == ["rollout: 16", "rollout: 32"]
