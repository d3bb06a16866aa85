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


#: Known defects of the series that its own tests catch, by test id, with the
#: reason; strict, so that a fix makes the run fail until the entry goes.
KNOWN_DEFECTS = {
    "test_compile_keep_keys_loss[DiscreteCQLLoss-compiled_first]": (
        "keep_keys v5: when the first call is compiled, DiscreteCQLLoss with "
        "keep_keys compiles one more graph than without (tensordict's dispatch "
        "wrapper is recompiled for a second function); eager first is equal"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if item.name in KNOWN_DEFECTS:
            reason = KNOWN_DEFECTS[item.name]
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
