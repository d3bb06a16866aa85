"""Import a series into a git work tree (its queue) and export it back."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from torchrl_fork.base import (
    extract_sources,
    Pin,
    repo_sources,
    RL_GIT_ENV,
    verified_wheel,
)
from torchrl_fork.gitcmd import git, git_blob
from torchrl_fork.series import (
    apply_patch,
    BASE_TAG,
    commit_tree,
    export_series,
    outside_wheel,
    patch_paths,
    placeholder_reason,
    series_paths,
    upstream_paths,
)

#: Author date of the pristine commit; fixed so that every import is identical.
BASE_DATE = "2000-01-01T00:00:00+00:00"
#: The base whose series goes upstream: its commits carry the sender as author.
UPSTREAM_BASE = "main"


class SenderError(RuntimeError):
    """The upstream series would be exported without a real author."""


def build_base_repo(repo: Path, pin: Pin) -> bool:
    """Make ``repo`` a git repository holding the verified pristine base as one commit.

    The base is the wheel's ``torchrl/`` tree, with the pinned documentation
    and test files where a pytorch/rl git directory is at hand. Returns whether
    they are there.
    """
    wheel = verified_wheel(pin)
    sources = repo_sources(pin)
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    extract_sources(wheel, repo)
    for relpath, content in (sources or {}).items():
        (repo / relpath).parent.mkdir(parents=True, exist_ok=True)
        (repo / relpath).write_bytes(content)
    commit_tree(repo, f"{pin.label} ({pin.source}), pristine", BASE_DATE)
    return sources is not None


def import_queue(
    pin: Pin, repo: Path | None = None, patches_dir: Path | None = None, force=False
) -> Path:
    """Build the queue: the pristine base, then one commit per patch of the series."""
    repo = repo or pin.queue_dir
    if repo.exists() and not force:
        if git("status", "--porcelain", cwd=repo).stdout.strip():
            raise RuntimeError(
                f"{repo} has uncommitted changes; commit or export them, "
                "or pass --force to discard them"
            )
    patches = series_paths(patches_dir or pin.patches_dir)
    pinned = set(pin.repo_files.get("files", {}))
    needing = [patch.name for patch in patches if patch_paths(patch) & pinned]
    if needing and not os.environ.get(RL_GIT_ENV):
        # without them, the queue could not carry those patches to export
        raise RuntimeError(
            f"{', '.join(needing)} change upstream files that the wheel lacks "
            f"(docs, tests): set {RL_GIT_ENV} to a git directory of pytorch/rl "
            f"holding commit {pin.repo_files['commit']}"
        )
    build_base_repo(repo, pin)
    for patch in patches:
        apply_patch(repo, patch)
    return repo


def sender_identity(author: str | None = None) -> str:
    """``author``, or the ``user.name`` and ``user.email`` of the user's git config."""
    if author:
        return author

    def config(key: str) -> str:
        return subprocess.run(
            ["git", "config", key], capture_output=True, text=True
        ).stdout.strip()

    return f"{config('user.name')} <{config('user.email')}>"


def export_queue(
    pin: Pin,
    repo: Path | None = None,
    patches_dir: Path | None = None,
    *,
    author: str | None = None,
    draft: bool = False,
    save_pin: bool = True,
) -> list[str]:
    """Regenerate the series and its ``series`` file from the queue, and re-pin files.

    The upstream series is exported with the sender as the author of every
    commit: ``author``, or the identity in the user's git config. A placeholder
    identity is refused, unless ``draft`` is set (a draft that is not sent, to
    be exported again by the sender). The pin records the sha256 of each
    upstream file the series modifies, as found in the queue's base commit.
    """
    repo = repo or pin.queue_dir
    patches_dir = patches_dir or pin.patches_dir
    if not (repo / ".git").exists():
        raise FileNotFoundError(f"no queue at {repo}; run 'import' first")
    if git("status", "--porcelain", "--untracked-files=no", cwd=repo).stdout.strip():
        raise RuntimeError(f"{repo} has uncommitted changes; commit them first")
    if pin.name == UPSTREAM_BASE or author:
        sender = sender_identity(author)
        reason = placeholder_reason(sender)
        if reason and not draft:
            raise SenderError(
                f"the upstream series needs its sender as author, but {reason}. "
                "Set user.name and user.email in git, or pass --author "
                "'Name <email>' (the identity that signed the pytorch/rl CLA)."
            )
        if not reason:
            _set_author(repo, sender)
    names = export_series(repo, patches_dir)
    if save_pin:
        files = {
            path: _base_sha256(repo, path)
            for path in upstream_paths([patches_dir / name for name in names])
        }
        outside = {path: files.pop(path) for path in outside_wheel(list(files))}
        if outside:
            pin = pin.replace(repo_files={**pin.repo_files, "files": outside})
        pin.replace(files=files).save()
    return names


def _set_author(repo: Path, sender: str) -> None:
    authors = git("log", "--format=%an <%ae>", f"{BASE_TAG}..HEAD", cwd=repo).stdout
    if set(authors.splitlines()) <= {sender}:
        return
    # --author keeps each commit's author date, so the patches' dates stay
    git(
        "rebase",
        "--quiet",
        "--exec",
        f"git commit --quiet --amend --no-edit --no-verify --author={shlex.quote(sender)}",
        BASE_TAG,
        cwd=repo,
    )


def _base_sha256(repo: Path, relpath: str) -> str:
    return hashlib.sha256(git_blob(repo, BASE_TAG, relpath)).hexdigest()
