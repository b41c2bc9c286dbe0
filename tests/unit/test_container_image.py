"""The image's build context: every source that slurm/Dockerfile COPYs or ADDs exists in the repository and is
admitted by slurm/Dockerfile.dockerignore, or `docker build -f slurm/Dockerfile .` stops at "not found".

BuildKit reads `<Dockerfile>.dockerignore` beside the Dockerfile in place of the context's .dockerignore. Its
rules are ported here from docker's own code, github.com/moby/patternmatcher: `ignorefile.ReadAll`
(comments, whitespace, path cleaning, leading "/" dropped) and `MatchesOrParentMatches` (patterns in order,
the last one that matches the path or one of its parent directories wins, `!` re-admits, `**` spans
directories). The port is checked against cases from patternmatcher's own test table."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKERFILE = REPO / "slurm" / "Dockerfile"
IGNORE_FILE = REPO / "slurm" / "Dockerfile.dockerignore"
_REGEX_ESCAPED = set(".+()|{}$")  # regex metacharacters that mean nothing in a path pattern


def go_clean(path: str) -> str:
    """Go's filepath.Clean on a slash path (posixpath.normpath, except that Go keeps one leading slash)."""
    cleaned = posixpath.normpath(path)
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


@dataclass
class Pattern:
    text: str
    exclusion: bool  # a `!` line: re-admits what it matches

    def __post_init__(self) -> None:
        self.kind, self.regex = self._compile()

    def _compile(self) -> tuple[str, re.Pattern[str] | None]:
        """patternmatcher's Pattern.compile: an exact, prefix (`dir/**`), suffix (`**/name`) or regexp
        match."""
        kind, regex, text, i = "exact", "^", self.text, 0
        while i < len(text):
            ch = text[i]
            if ch == "*" and text[i + 1 : i + 2] == "*":
                start = i
                i += 2
                if text[i : i + 1] == "/":  # "**/" is "**"
                    i += 1
                if i == len(text):
                    if kind == "exact":
                        kind = "prefix"
                    else:
                        regex += ".*"
                        kind = "regexp"
                else:
                    regex += "(.*/)?"
                    kind = "regexp"
                if start == 0:
                    kind = "suffix"
                continue
            if ch == "*":
                regex += "[^/]*"
                kind = "regexp"
            elif ch == "?":
                regex += "[^/]"
                kind = "regexp"
            elif ch in _REGEX_ESCAPED:
                regex += "\\" + ch
            elif ch == "\\":
                if i + 1 < len(text):
                    i += 1
                    regex += "\\" + text[i]
                    kind = "regexp"
                else:
                    regex += "\\\\"
            elif ch in "[]":
                regex += ch
                kind = "regexp"
            else:
                regex += ch
            i += 1
        return kind, re.compile(regex + "$") if kind == "regexp" else None

    def match(self, path: str) -> bool:
        if self.kind == "exact":
            return path == self.text
        if self.kind == "prefix":
            return path.startswith(self.text[:-2])
        if self.kind == "suffix":
            suffix = self.text[2:]
            return path.endswith(suffix) or (suffix.startswith("/") and path == suffix[1:])
        assert self.regex is not None
        return self.regex.match(path) is not None


def read_ignore(text: str) -> list[Pattern]:
    """ignorefile.ReadAll, then patternmatcher.New."""
    patterns = []
    for line in text.removeprefix("\ufeff").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        line = line.strip()
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
            if not line:
                raise ValueError('illegal exclusion pattern: "!"')
        line = go_clean(line)
        if len(line) > 1 and line.startswith("/"):
            line = line[1:]
        patterns.append(Pattern(line, exclusion))
    return patterns


def excluded(patterns: list[Pattern], path: str) -> bool:
    """patternmatcher's MatchesOrParentMatches: True when `path` (relative, slash-separated) is left out."""
    matched = False
    for pattern in patterns:
        if pattern.exclusion != matched:  # only a `!` can undo a match, only a plain pattern can make one
            continue
        if any(pattern.match(candidate) for candidate in [path, *ancestors(path)[:-1]]):
            matched = not pattern.exclusion
    return matched


def copy_sources(dockerfile: str) -> list[tuple[str, str]]:
    """(instruction line, source) for every COPY/ADD source taken from the build context: not `--from` another
    stage or image, not a URL, not a heredoc. Continuation lines are joined; the JSON form is read too."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    sources = []
    for line in joined.splitlines():
        words = line.strip()
        match = re.match(r"(?i)(COPY|ADD)\s+(.*)", words)
        if not match:
            continue
        args = match.group(2).strip()
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        options = [p for p in parts if p.startswith("--")]
        operands = [p for p in parts if not p.startswith("--")]
        if any(option.startswith("--from=") for option in options):
            continue
        for source in operands[:-1]:
            if source.startswith("<<") or re.match(r"(https?|git)://|git@", source):
                continue
            sources.append((words, source))
    return sources


def context_files(root: Path, source: str) -> list[str]:
    """The repository's files that COPY `source` takes (the path itself, what lies under it, or what a
    wildcard matches, as Go's filepath.Match does), relative to `root`: git's tracked files in a git work
    tree, else every file on disk but Python's caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = [
            path.relative_to(root).as_posix()
            for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
        ]
    wanted = Pattern(source.rstrip("/"), exclusion=False)
    return sorted(
        name for name in listed if name and any(wanted.match(ancestor) for ancestor in ancestors(name))
    )


def ancestors(path: str) -> list[str]:
    """`a/b/c` -> `a`, `a/b`, `a/b/c`."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def context_problems(dockerfile: str, ignore: str, root: Path) -> list[str]:
    """One line per COPY/ADD source the build would not find: missing from `root`, or left out of the context
    by the ignore rules (a directory: any of its files left out)."""
    patterns = read_ignore(ignore)
    problems = []
    for instruction, source in copy_sources(dockerfile):
        relative = go_clean(source).lstrip("/")
        files = context_files(root, relative)
        if not files and not (root / relative).exists():
            problems.append(f"{source} (in `{instruction}`) does not exist in the repository")
            continue
        left_out = [name for name in files or [relative] if excluded(patterns, name)]
        if left_out:
            problems.append(
                f"{source} (in `{instruction}`) is not in the build context: the ignore file leaves out "
                f"{', '.join(left_out[:3])}{' ...' if len(left_out) > 3 else ''}; admit it with `!{relative}`"
            )
    return problems


def test_every_copy_source_is_in_the_build_context() -> None:
    problems = context_problems(DOCKERFILE.read_text(), IGNORE_FILE.read_text(), REPO)
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_source_left_out_or_missing(tmp_path: Path) -> None:
    """An ignore file that admits some of the copied paths, as one that forgot LICENSE and configs/ did."""
    for name in ("README.md", "LICENSE", "configs/a.yaml", "configs/sub/b.yaml", "pkg/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    dockerfile = (
        "FROM base AS build\n"
        "COPY --chown=0:0 README.md \\\n     LICENSE /src/\n"
        'COPY ["configs", "/src/configs"]\n'
        "ADD pkg /src/pkg\n"
        "COPY missing.txt /src/\n"
        "COPY --from=build /etc/hosts /x\n"
        "ADD https://example.com/a.tar.gz /x\n"
    )
    problems = context_problems(dockerfile, "*\n!README.md\n!pkg\n**/__pycache__\n", tmp_path)
    assert len(problems) == 3, problems
    assert problems[0].startswith("LICENSE (in `COPY --chown=0:0 README.md")
    assert "configs (in `COPY" in problems[1] and "configs/a.yaml, configs/sub/b.yaml" in problems[1]
    assert problems[2].startswith("missing.txt") and "does not exist" in problems[2]
    assert context_problems(dockerfile.replace("COPY missing.txt /src/\n", ""), "*\n!*\n", tmp_path) == []


# (pattern, path, left out): from patternmatcher_test.go's TestMatches, run through MatchesOrParentMatches.
DOCKER_CASES = [
    ("**", "file", True),
    ("**/", "file", True),
    ("**", "dir/file", True),
    ("**/**", "dir/file", True),
    ("dir/**", "dir/file", True),
    ("dir/**", "dir/dir2/file", True),
    ("**/dir", "dir", True),
    ("**/dir", "dir/file", True),
    ("**/dir2/*", "dir/dir2/file", True),
    ("**/dir2/**", "dir/dir2/dir3/file", True),
    ("**file", "dir/dir/file", True),
    ("**/file*.txt", "dir/dir/file.txt", True),
    ("**/**/*.txt2", "dir/dir/file.txt", False),
    ("**/*.txt", "file.txt", True),
    ("a**/*.txt", "a/dir/dir/file.txt", True),
    ("a/*.txt", "a/dir/file.txt", False),
    ("a/*.txt", "a/file.txt", True),
    ("a/*.txt**", "a/file.txt", True),
    ("a[b-d]e", "ace", True),
    ("a[b-d]e", "aae", False),
    ("a[^b-d]e", "aze", True),
    (".*", ".foo", True),
    (".*", "foo", False),
    ("abc.def", "abcZdef", False),
    ("abc?def", "abcZdef", True),
    ("a\\\\", "a\\", True),
    ("a\\*b", "a*b", True),
    ("**/foo/bar", "foo/bar", True),
    ("abc/**", "abc", False),
    ("abc/**", "abc/def/ghi", True),
    ("**/.foo", "bar.foo", False),
    ("a(b)c/def", "a(b)c/def", True),
    ("a.|)$(}+{bc", "a.|)$(}+{bc", True),
    ("dist/*.whl", "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", True),
    ("docs/", "docs/README.md", True),
    ("/docs", "docs/README.md", True),
]
DOCKER_MULTI_CASES = [
    (["**", "!util/docker/web"], "util/docker/web/foo", False),
    (["**", "!util/docker/web", "util/docker/web/foo"], "util/docker/web/foo", True),
    (["**", "!dist/*.whl"], "dist/proxy.py-2.4.0rc3.dev36+g08acad9-py3-none-any.whl", False),
    (["docs", "!docs/README.md"], "docs/README.md", False),
    (["*.go", "!fileutils.go"], "fileutils.go", False),
    (["!fileutils.go", "*.go"], "fileutils.go", True),
    (["*", "!configs"], "configs/experiment/a.yaml", False),
    (["*", "!configs", "**/__pycache__"], "configs/__pycache__/a.pyc", True),
]


@pytest.mark.parametrize(("pattern", "path", "left_out"), DOCKER_CASES)
def test_ignore_rules_match_dockers(pattern: str, path: str, left_out: bool) -> None:
    assert excluded(read_ignore(pattern), path) is left_out


@pytest.mark.parametrize(("patterns", "path", "left_out"), DOCKER_MULTI_CASES)
def test_ignore_rules_in_order_match_dockers(patterns: list[str], path: str, left_out: bool) -> None:
    assert excluded(read_ignore(os.linesep.join(["# a comment", *patterns, ""])), path) is left_out
