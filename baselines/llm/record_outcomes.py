"""pytest plugin: write "<outcome>\t<node id>" per test to $LLM_OUTCOMES, for run.sh's lists.

A test counts as passed only if its call passed and neither setup nor teardown failed.
Reports from xdist workers reach the controller, which alone writes the file.
"""

import os

_outcomes = {}
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3}


def pytest_runtest_logreport(report):
    if report.when == "call":
        outcome = (
            "xfailed"
            if hasattr(report, "wasxfail") and report.skipped
            else report.outcome
        )
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    previous = _outcomes.get(report.nodeid)
    if previous is None or _RANK[outcome] > _RANK[previous]:
        _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session):
    path = os.environ.get("LLM_OUTCOMES")
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w") as f:
            f.writelines(
                f"{outcome}\t{nodeid}\n" for nodeid, outcome in _outcomes.items()
            )
