"""The metric tags README.md's Monitoring table documents, for the tests that check runs write them."""

from __future__ import annotations

import re

from tests.conftest import REPO

ALWAYS = ("start-up", "every step", "evaluation")
"""`written` values a demo run with evaluations covers; the others name a setting or hardware."""


def expand(pattern: str) -> list[str]:
    """`a/{b,c}/d` -> `a/b/d`, `a/c/d` (every brace group, left to right)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [
        name
        for choice in match.group(1).split(",")
        for name in expand(pattern[: match.start()] + choice + pattern[match.end() :])
    ]


def readme_tags() -> dict[str, str]:
    """Tag (with `<data_source>` and `<k>` left in) -> when it is written, from the Monitoring table."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Monitoring\n") :]
    section = section[: section.index("\n## ", 1)]
    tags: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        assert len(cells) == 3 and all(cells), (
            f"README Monitoring table row needs tag | written | meaning: {line}"
        )
        for tag in expand(cells[0].strip("`")):
            assert tag not in tags, f"{tag} appears twice in README's Monitoring table"
            tags[tag] = cells[1]
    return tags


def concrete(tag: str, *, data_source: str, k: int) -> str:
    return tag.replace("<data_source>", data_source).replace("<k>", str(k))


def documented(name: str, tags: dict[str, str]) -> bool:
    """Whether a written metric `name` is one of `tags` (any data source, any k)."""
    for tag in tags:
        pattern = re.escape(tag).replace("<data_source>", r"[^/]+").replace("<k>", r"\d+")
        if re.fullmatch(pattern, name):
            return True
    return False
