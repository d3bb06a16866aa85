"""Try the series on another torchrl release and report what happens to each patch."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torchrl_fork import BUILD_DIR
from torchrl_fork.base import download_wheel, extract_sources, Pin
from torchrl_fork.gitcmd import git, git_env
from torchrl_fork.queue import build_base_repo
from torchrl_fork.series import (
    AM_OPTIONS,
    apply_patch,
    BASE_TAG,
    HUNK_ERROR,
    is_docs_patch,
    outside_wheel,
    series_paths,
    SeriesError,
)

APPLIES = "applies"
CONFLICTS = "conflicts"
UPSTREAM = "already upstream"
#: a patch of the documentation, which release wheels do not carry
NOT_TRIED = "not tried"
#: release wheels carry no tests: only the torchrl/ part of each patch is tried
INCLUDE = "--include=torchrl/*"
MERGE_CONFLICT = re.compile(r"CONFLICT \([^)]*\): Merge conflict in (\S+)")


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
    patches_dir: Path | None = None,
    repo: Path | None = None,
) -> list[Outcome]:
    """Apply the series onto ``package==version`` and report each patch.

    ``repo`` gets the pinned base with the series applied (so that git knows
    every blob the patches were made against), then a branch ``rebased``: the
    release's sources committed on top of the pinned base, with the series
    applied by ``git am --3way``. A patch applies (possibly through a clean
    three-way merge), conflicts (the hunk that fails and the file that does not
    merge are named; the patch is skipped so that the others can be tried), or
    is already upstream (the merge leaves nothing to change). The result is
    left in ``repo`` for manual fixing.
    """
    repo = repo or BUILD_DIR / f"rebase-{package}-{version}"
    pin = Pin.load()
    build_base_repo(repo, pin)
    series = series_paths(patches_dir or pin.patches_dir)
    patches = [patch for patch in series if not is_docs_patch(patch)]
    # release wheels carry no docs or tests: only torchrl/ is rebased
    outside = outside_wheel(pin.repo_files.get("files", {}))
    try:
        for patch in patches:
            apply_patch(repo, patch, exclude=outside)
    except SeriesError:
        pass  # no three-way fallback from the first patch that does not apply
    git("checkout", "--quiet", "-b", "rebased", BASE_TAG, cwd=repo)
    shutil.rmtree(repo / "torchrl")
    extract_sources(download_wheel(package, version), repo)
    git("add", "--all", "--force", "torchrl", cwd=repo)
    git(
        "commit",
        "--quiet",
        "--allow-empty",
        "-m",
        f"{package} {version}",
        cwd=repo,
        env=git_env(GIT_AUTHOR_DATE="2000-01-01T00:00:00+00:00"),
    )
    applied = git("rev-list", "--reverse", f"{BASE_TAG}..main", cwd=repo).stdout.split()
    outcomes = {
        patch.name: Outcome(patch.name, NOT_TRIED, "it patches the documentation")
        for patch in series
    }
    for index, patch in enumerate(patches):
        outcome = _apply(repo, patch)
        if outcome.status == CONFLICTS and _merged_upstream(repo, applied[index:]):
            outcome = Outcome(patch.name, UPSTREAM, "together with later patches")
        outcomes[patch.name] = outcome
    return list(outcomes.values())


def _merged_upstream(repo: Path, states: list[str]) -> bool:
    """Whether the series up to one of ``states`` is contained in ``HEAD``.

    A patch whose lines a later patch changes again cannot be found upstream
    alone once upstream merged both: the combined change, from the pinned base
    to that later patch, three-way merges into the release with nothing left
    to change.
    """
    for state in states:
        diff = git(
            "diff", "--full-index", BASE_TAG, state, "--", "torchrl", cwd=repo
        ).stdout
        merged = git("apply", "--3way", "--cached", cwd=repo, check=False, input=diff)
        unchanged = git("diff", "--cached", "--quiet", cwd=repo, check=False)
        git("reset", "--quiet", cwd=repo)
        if merged.returncode == 0 and unchanged.returncode == 0:
            return True
    return False


def _apply(repo: Path, patch: Path) -> Outcome:
    before = git("rev-parse", "HEAD", cwd=repo).stdout.strip()
    exact = git("am", *AM_OPTIONS, INCLUDE, str(patch), cwd=repo, check=False)
    if exact.returncode == 0:
        return Outcome(patch.name, APPLIES)
    git("am", "--abort", cwd=repo, check=False)
    options = [option for option in AM_OPTIONS if option != "--no-3way"]
    merged = git("am", *options, "--3way", INCLUDE, str(patch), cwd=repo, check=False)
    if merged.returncode == 0:
        if (
            git("rev-parse", "HEAD^{tree}", cwd=repo).stdout
            == git("rev-parse", f"{before}^{{tree}}", cwd=repo).stdout
        ):
            return Outcome(patch.name, UPSTREAM)
        return Outcome(patch.name, APPLIES, "three-way merge")
    output = merged.stdout + merged.stderr
    git("am", "--abort", cwd=repo, check=False)
    if "No changes" in output:
        return Outcome(patch.name, UPSTREAM)
    hunk = HUNK_ERROR.search(exact.stderr)
    files = sorted(set(MERGE_CONFLICT.findall(output)))
    detail = f"hunk at {hunk.group('where')}" if hunk else exact.stderr.strip()
    if files:
        detail += f"; merge conflict in {', '.join(files)}"
    return Outcome(patch.name, CONFLICTS, detail)
