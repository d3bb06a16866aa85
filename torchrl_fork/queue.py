"""Import the series into a git work tree (the queue) and export it back."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from torchrl_fork import PATCHES_DIR, QUEUE_DIR
from torchrl_fork.base import extract_sources, Pin, PIN_FILE, verified_wheel
from torchrl_fork.gitcmd import git, git_blob
from torchrl_fork.series import (
    apply_patch,
    BASE_TAG,
    commit_tree,
    export_series,
    series_paths,
    upstream_paths,
)

#: Author date of the pristine commit; fixed so that every import is identical.
BASE_DATE = "2000-01-01T00:00:00+00:00"


def build_base_repo(repo: Path, pin: Pin | None = None) -> Path:
    """Make ``repo`` a git repository holding the verified pristine base as one commit."""
    pin = pin or Pin.load()
    wheel = verified_wheel(pin)
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    extract_sources(wheel, repo, pin.package)
    commit_tree(repo, f"torchrl {pin.version} ({pin.git_tag}), pristine", BASE_DATE)
    return repo


def import_queue(
    repo: Path = QUEUE_DIR, patches_dir: Path = PATCHES_DIR, force: bool = False
) -> Path:
    """Build the queue: the pristine base, then one commit per patch of the series."""
    if repo.exists() and not force:
        if git("status", "--porcelain", cwd=repo).stdout.strip():
            raise RuntimeError(
                f"{repo} has uncommitted changes; commit or export them, "
                "or pass --force to discard them"
            )
    build_base_repo(repo)
    for patch in series_paths(patches_dir):
        apply_patch(repo, patch)
    return repo


def export_queue(
    repo: Path = QUEUE_DIR, patches_dir: Path = PATCHES_DIR, pin_file: Path = PIN_FILE
) -> list[str]:
    """Regenerate ``patches/`` and its series from the queue, and re-pin touched files.

    The pin records the sha256 of each upstream file the series modifies, as
    found in the queue's pristine base commit.
    """
    if not (repo / ".git").exists():
        raise FileNotFoundError(f"no queue at {repo}; run 'import' first")
    if git("status", "--porcelain", "--untracked-files=no", cwd=repo).stdout.strip():
        raise RuntimeError(f"{repo} has uncommitted changes; commit them first")
    names = export_series(repo, patches_dir)
    pin = Pin.load(pin_file)
    patches = [patches_dir / name for name in names]
    files = {path: _base_sha256(repo, path) for path in upstream_paths(patches)}
    Pin(pin.package, pin.version, pin.git_tag, files).save(pin_file)
    return names


def _base_sha256(repo: Path, relpath: str) -> str:
    return hashlib.sha256(git_blob(repo, BASE_TAG, relpath)).hexdigest()
