"""Test set-up: the series' own upstream-style tests run against the installed fork.

The series adds test files under ``test/`` of pytorch/rl. Before collection,
they are extracted from ``patches/`` into ``test/series/`` (git-ignored), so
that ``python -m pytest`` runs them against whatever torchrl is installed.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.series import series_paths

SERIES_TESTS = Path(__file__).parent / "series"


def extract_series_tests(dest: Path = SERIES_TESTS) -> None:
    """Apply the ``test/`` part of every patch, in order, into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(dest.parent))
    for patch in series_paths(Pin.load().patches_dir):
        subprocess.run(
            ["git", "apply", "--include=test/*", str(patch)],
            cwd=dest,
            env=env,
            check=True,
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        extract_series_tests()
