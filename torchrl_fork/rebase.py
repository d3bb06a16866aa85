"""Try the series on another torchrl release and report what happens to each patch."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from torchrl_fork import BUILD_DIR, PATCHES_DIR
from torchrl_fork.base import download_wheel, extract_sources
from torchrl_fork.gitcmd import git
from torchrl_fork.series import AM_OPTIONS, commit_tree, HUNK_ERROR, series_paths

APPLIES = "applies"
CONFLICTS = "conflicts"
UPSTREAM = "already upstream"


@dataclass(frozen=True)
class Outcome:
    patch: str
    status: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.patch}: {self.status}" + (
            f" ({self.detail})" if self.detail else ""
        )


def rebase_series(
    version: str,
    package: str = "torchrl",
    patches_dir: Path = PATCHES_DIR,
    repo: Path | None = None,
) -> list[Outcome]:
    """Apply the series onto ``package==version`` in ``repo`` (a fresh queue).

    Each patch is reported as applying, conflicting (with the file and hunk
    that fail) or already upstream (it reverse-applies cleanly). Patches that
    do not apply are skipped so that the rest can still be tried; the result
    is left in ``repo`` for manual fixing.
    """
    repo = repo or BUILD_DIR / f"rebase-{package}-{version}"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    wheel = download_wheel(version, package=package)
    extract_sources(wheel, repo, "torchrl")
    commit_tree(repo, f"{package} {version}, pristine", "2000-01-01T00:00:00+00:00")
    outcomes = []
    for patch in series_paths(patches_dir):
        result = git("am", *AM_OPTIONS, str(patch), cwd=repo, check=False)
        if result.returncode == 0:
            outcomes.append(Outcome(patch.name, APPLIES))
            continue
        git("am", "--abort", cwd=repo, check=False)
        # release wheels carry no tests, so only the torchrl/ part can be upstream
        reverse = git(
            "apply",
            "--check",
            "--reverse",
            "--include=torchrl/*",
            str(patch),
            cwd=repo,
            check=False,
        )
        if reverse.returncode == 0:
            outcomes.append(Outcome(patch.name, UPSTREAM))
            continue
        where = HUNK_ERROR.search(result.stderr)
        detail = f"hunk at {where.group('where')}" if where else result.stderr.strip()
        outcomes.append(Outcome(patch.name, CONFLICTS, detail))
    return outcomes
