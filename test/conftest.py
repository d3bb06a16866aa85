"""Test set-up: the series' own upstream-style tests run against the installed fork.

The series adds test files under ``test/`` of pytorch/rl. Before collection,
they are extracted from ``patches/`` into ``test/series/`` (git-ignored), so
that ``python -m pytest`` runs them against whatever torchrl is installed.
"""

from pathlib import Path

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.series import extract_tests

SERIES_TESTS = Path(__file__).parent / "series"


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        extract_tests(Pin.load().patches_dir, SERIES_TESTS)
