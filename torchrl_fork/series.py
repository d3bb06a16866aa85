"""Read, export, apply and check the patch series."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from email.utils import parseaddr
from pathlib import Path

from torchrl_fork.gitcmd import git, git_env

BASE_TAG = "base"
FORMAT_PATCH_OPTIONS = (
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-numbered",
    "--no-renames",
)
AM_OPTIONS = ("--keep-non-patch", "--no-3way", "--committer-date-is-author-date")
SUBJECT = re.compile(r"^Subject: \[PATCH\] \[[A-Z][A-Za-z]+\] \S", re.MULTILINE)
#: Debian (DEP-3) patch metadata, which pytorch/rl's commits do not carry.
DEP3_TRAILERS = (
    "Bug",
    "Bug-Debian",
    "Forwarded",
    "Last-Update",
    "Origin",
    "Applied-Upstream",
)
HUNK_ERROR = re.compile(r"error: patch failed: (?P<where>\S+)")
#: Domains reserved for examples and tests (RFC 2606, RFC 6761): no one can
#: sign a CLA with an address there.
RESERVED_DOMAINS = ("example", "invalid", "localhost", "test", "local")


class SeriesError(RuntimeError):
    """A patch of the series is malformed or does not apply."""


def read_series(series_file: Path) -> list[str]:
    """Patch file names in series order; blank lines and ``#`` comments skipped."""
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def series_paths(patches_dir: Path) -> list[Path]:
    return [patches_dir / name for name in read_series(patches_dir / "series")]


def placeholder_reason(identity: str) -> str | None:
    """Why ``Name <email>`` cannot be a patch author upstream, or ``None``."""
    name, email = parseaddr(identity)
    if not name or "@" not in email:
        return f"{identity!r} is not of the form 'Name <email>'"
    domain = email.rsplit("@", 1)[1].lower().rstrip(".")
    labels = domain.split(".")
    if labels[-1] in RESERVED_DOMAINS or labels[-2:] in (
        ["example", "com"],
        ["example", "net"],
        ["example", "org"],
    ):
        return f"{email} is a placeholder address (reserved domain {domain})"
    return None


def patch_author(patch: Path) -> str:
    header = patch.read_text().split("\nSubject: ", 1)[0]
    match = re.search(r"^From: (.*(?:\n .*)*)", header, re.MULTILINE)
    return " ".join(match.group(1).split()) if match else ""


def header_problems(patch: Path) -> list[str]:
    """What the patch's mail header and message lack or should not carry."""
    text = patch.read_text()
    message = text.split("\n---\n", 1)[0]
    problems = []
    if not text.startswith("From 0000000000000000000000000000000000000000 "):
        problems.append("not exported with --zero-commit")
    if not SUBJECT.search(message):
        problems.append("subject is not of the form '[PATCH] [Tag] summary'")
    for trailer in DEP3_TRAILERS:
        if re.search(rf"^{trailer}: \S", message, re.MULTILINE):
            problems.append(f"carries the DEP-3 trailer '{trailer}:'")
    if re.search(r"^-- \n", text, re.MULTILINE):
        problems.append("carries a signature; export with --no-signature")
    return [f"{patch.name}: {problem}" for problem in problems]


def _diff_headers(patch: Path) -> list[str]:
    return [
        block.split("\n@@", 1)[0]
        for block in patch.read_text().split("\ndiff --git ")[1:]
    ]


def patch_paths(patch: Path) -> set[str]:
    """The paths that ``patch`` changes."""
    return {
        match.group(1)
        for header in _diff_headers(patch)
        for match in [re.search(r"^\+\+\+ b/(\S+)$", header, re.MULTILINE)]
        if match
    }


def outside_wheel(paths: Iterable[str]) -> set[str]:
    """The paths of ``paths`` that a torchrl wheel does not carry (docs, tests)."""
    return {path for path in paths if not path.startswith("torchrl/")}


def is_docs_patch(patch: Path) -> bool:
    """Whether ``patch`` changes documentation only, which wheels do not carry."""
    return all(path.startswith("docs/") for path in patch_paths(patch))


def upstream_paths(patches: list[Path]) -> dict[str, str]:
    """Upstream files that the series modifies, each with the first patch touching it.

    Files that a patch of the series creates are not upstream's, even when a
    later patch modifies them.
    """
    created, paths = set(), {}
    for patch in patches:
        for header in _diff_headers(patch):
            target = re.search(r"^\+\+\+ b/(\S+)$", header, re.MULTILINE)
            if "\nnew file mode" in header and target:
                created.add(target.group(1))
                continue
            match = re.search(r"^--- a/(\S+)$", header, re.MULTILINE)
            if match and match.group(1) not in created | set(paths):
                paths[match.group(1)] = patch.name
    return paths


def export_series(repo: Path, dest: Path, base: str = BASE_TAG) -> list[str]:
    """Write one ``git format-patch`` file per commit after ``base`` into ``dest``.

    Returns the file names in order. ``dest/series`` is rewritten, keeping its
    leading comment block. Other files in ``dest`` (a nested series) are left.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = ("format-patch", *FORMAT_PATCH_OPTIONS, "-o", tmp, f"{base}..HEAD")
        out = git(*args, cwd=repo).stdout
        names = [Path(line).name for line in out.splitlines() if line.strip()]
        for old in dest.glob("*.patch"):
            if old.name not in names:
                old.unlink()
        for name in names:
            shutil.copyfile(Path(tmp) / name, dest / name)
    series = dest / "series"
    comments = []
    if series.exists():
        for line in series.read_text().splitlines():
            if not line.startswith("#"):
                break
            comments.append(line)
    series.write_text("\n".join([*comments, *names]) + "\n")
    return names


def commit_tree(repo: Path, message: str, date: str) -> None:
    """Commit everything in ``repo`` (a fresh ``git init``) and tag it as the base."""
    env_date = {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    git("init", "--quiet", "--initial-branch=main", cwd=repo)
    git("add", "--all", "--force", cwd=repo)
    git(
        "commit",
        "--quiet",
        "--no-verify",
        "-m",
        message,
        cwd=repo,
        env=git_env(**env_date),
    )
    git("tag", BASE_TAG, cwd=repo)


def apply_patch(repo: Path, patch: Path, exclude: Iterable[str] = ()) -> None:
    """``git am`` one patch onto ``repo``; on failure abort and name patch and hunk.

    The paths in ``exclude`` are left out of the commit.
    """
    skip = [f"--exclude={path}" for path in exclude]
    result = git("am", *AM_OPTIONS, *skip, str(patch), cwd=repo, check=False)
    if result.returncode == 0:
        return
    git("am", "--abort", cwd=repo, check=False)
    where = HUNK_ERROR.search(result.stderr)
    detail = f"hunk at {where.group('where')}" if where else result.stderr.strip()
    raise SeriesError(f"{patch.name} does not apply: {detail}")


def compare_exports(
    expected: Path,
    actual: Path,
    names: list[str],
    left_out: dict[str, set[str]] | None = None,
) -> list[str]:
    """Name each patch of ``names`` whose file in ``actual`` differs from ``expected``.

    For a patch of ``left_out``, applied without some of its paths, only the
    diffs of its other paths are compared.
    """
    problems = []
    for name in names:
        want = (expected / name).read_text() if (expected / name).exists() else None
        got = (actual / name).read_text() if (actual / name).exists() else None
        if want is not None and got is not None and name in (left_out or {}):
            want, got = (_diffs(text, left_out[name]) for text in (want, got))
        if want == got:
            continue
        problems.append(f"{name}: {_first_difference(want, got)}")
    return problems


def _diffs(patch_text: str, without: set[str]) -> str:
    """The file diffs of a patch, but those of the paths in ``without``."""
    blocks = patch_text.split("\ndiff --git ")[1:]
    return "".join(
        block for block in blocks if block.split(" ", 1)[0][2:] not in without
    )


def _first_difference(want: str | None, got: str | None) -> str:
    if want is None or got is None:
        return "missing from the series" if want is None else "not produced by export"
    hunk = "header"
    for line_want, line_got in zip(want.splitlines(), got.splitlines()):
        if line_want.startswith("@@"):
            hunk = line_want.split("@@")[1].strip()
        if line_want != line_got:
            return f"differs in hunk {hunk!r}: {line_want!r} != {line_got!r}"
    return "differs in length"


def apply_part(patch: Path, root: Path, include: str) -> None:
    """``git apply`` the paths of ``patch`` matching ``include`` onto the tree ``root``.

    ``root`` need not be a repository; git treats it as the top of the tree,
    even when it lies inside one (a checkout's ``build/``, say).
    """
    # git ignores a relative ceiling, and inside a repository it would skip
    # every path outside the current folder without a word
    root = root.resolve()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    result = subprocess.run(
        [
            "git",
            "apply",
            f"--include={include}",
            str(patch),
        ],
        cwd=root,
        env=env,
        text=True,
        capture_output=True,
    )
    if result.returncode:
        raise SeriesError(f"{patch.name} does not apply: {result.stderr.strip()}")
