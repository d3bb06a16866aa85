"""pytest-benchmark timings of keep_keys: off, on, on with an auxiliary loss, and the workaround.

Run with ``python -m pytest benchmarks/test_keep_keys_benchmarks.py``; the
ratios are printed by ``python benchmarks/report.py`` (see README.md here).
"""

import pytest
from keep_keys_cases import CASES, MODES


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_cls", CASES, ids=[c.name for c in CASES])
def test_keep_keys_step(benchmark, case_cls, mode):
    case = case_cls()
    benchmark.group = case.name
    benchmark.extra_info["mode"] = mode
    benchmark.pedantic(case.step, args=(mode,), rounds=15, warmup_rounds=2)
