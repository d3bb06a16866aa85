"""Run git hermetically, so no user or system configuration changes what it writes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

IDENTITY = {
    "GIT_AUTHOR_NAME": "TorchRL keep_keys fork",
    "GIT_AUTHOR_EMAIL": "keepkeys-fork@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "TorchRL keep_keys fork",
    "GIT_COMMITTER_EMAIL": "keepkeys-fork@users.noreply.github.com",
}


def git_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    for key, value in IDENTITY.items():
        env.setdefault(key, value)
    env.update(extra)
    return env


def git(
    *args: str,
    cwd: Path,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``git ARGS`` in ``cwd`` and return the completed process (text mode)."""
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=env or git_env(),
        check=check,
        text=True,
        capture_output=True,
        input=input,
    )


def git_blob(repo: Path, rev: str, relpath: str) -> bytes:
    """The bytes of ``relpath`` at ``rev``."""
    return subprocess.run(
        ["git", "show", f"{rev}:{relpath}"],
        cwd=repo,
        env=git_env(),
        check=True,
        capture_output=True,
    ).stdout
