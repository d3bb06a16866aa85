"""pytest-benchmark timings of keep_keys, every mode of a case measured side by side.

Each benchmark round runs one step of every mode of a case (see
``keep_keys_cases.py``) in a rotating order, so that drift affects all modes
alike; the ratios of the per-round times are stored in ``extra_info``.
Run with ``python -m pytest -o addopts= -p no:xdist benchmarks/test_keep_keys_benchmarks.py``; the
table is printed by ``python benchmarks/report.py``.
"""

import statistics
import time

import pytest
from keep_keys_cases import CASES, MODES

ROUNDS = 30
RATIOS = {
    "on/off": ("on", "off"),
    "workaround/on": ("workaround_aux", "on_aux"),
    "extractors' share": ("extractors", "on_aux"),
}


@pytest.mark.parametrize("case_cls", CASES, ids=[c.name for c in CASES])
def test_keep_keys_modes(benchmark, case_cls):
    case = case_cls()
    order = list(MODES)
    times = {mode: [] for mode in MODES}

    def one_round():
        order.append(order.pop(0))
        for mode in order:
            case.prepare(mode)
            start = time.perf_counter()
            case.step(mode)
            times[mode].append(time.perf_counter() - start)

    one_round()  # warm-up
    for values in times.values():
        values.clear()
    benchmark.group = "keep_keys"
    benchmark.pedantic(one_round, rounds=ROUNDS)
    benchmark.extra_info["median_s"] = {
        mode: statistics.median(values) for mode, values in times.items()
    }
    benchmark.extra_info["ratios"] = {
        name: statistics.median(a / b for a, b in zip(times[num], times[den]))
        for name, (num, den) in RATIOS.items()
    }
