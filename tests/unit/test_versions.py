"""Package versions: metadata first, the module's __version__ for source builds, None when absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo_megatron import versions


def test_an_installed_distribution_reports_its_metadata_version() -> None:
    assert versions.package_version("torch") == torch.__version__


def test_a_source_build_without_metadata_reports_its_module_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "srcbuilt_pkg").mkdir()
    (tmp_path / "srcbuilt_pkg" / "__init__.py").write_text('__version__ = "2.8.0+abc"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(versions.PACKAGES, "TE", (("no-such-distribution",), "srcbuilt_pkg"))
    assert versions.package_version("TE") == "2.8.0+abc"


@pytest.mark.parametrize("module", ["no_such_module_here", "no_such_parent.core"])
def test_an_absent_package_reports_none(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(versions.PACKAGES, "TE", (("no-such-distribution",), module))
    assert versions.package_version("TE") is None
