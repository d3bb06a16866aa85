"""Import a series into a git work tree (its queue) and export it back."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from torchrl_fork.base import (
    docs_sources,
    extract_sources,
    Pin,
    RL_GIT_ENV,
    verified_wheel,
)
from torchrl_fork.gitcmd import git, git_blob
from torchrl_fork.series import (
    apply_patch,
    BASE_TAG,
    commit_tree,
    export_series,
    is_docs_patch,
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
    files where a pytorch/rl git directory is at hand. Returns whether they
    are there.
    """
    wheel = verified_wheel(pin)
    docs = docs_sources(pin)
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    extract_sources(wheel, repo)
    for relpath, content in (docs or {}).items():
        (repo / relpath).parent.mkdir(parents=True, exist_ok=True)
        (repo / relpath).write_bytes(content)
    commit_tree(repo, f"{pin.label} ({pin.source}), pristine", BASE_DATE)
    return docs is not None


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
    docs_patches = [patch.name for patch in patches if is_docs_patch(patch)]
    if docs_patches and pin.docs and not os.environ.get(RL_GIT_ENV):
        # without them, the queue could not carry the docs patches to export
        raise RuntimeError(
            f"{', '.join(docs_patches)} change the documentation, which the "
            f"wheel lacks: set {RL_GIT_ENV} to a git directory of pytorch/rl "
            f"holding commit {pin.docs['commit']}"
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
        docs = {
            path: files.pop(path) for path in list(files) if path.startswith("docs/")
        }
        if docs:
            pin = pin.replace(docs={**pin.docs, "files": docs})
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
