"""With ``keep_keys`` off, the patched torchrl runs stock torchrl's aten ops.

The same ops, in the same order, for each loss case of ``test_keep_keys.py``
and each value estimator call path, against the digests that ``aten_ops.py``
recorded on the stock wheel of the same version. Bitwise equal outputs are
tested in ``test_keep_keys.py``; this catches a changed path that still gives
equal values (an extra ``select``, one ``cat`` for two).
"""
from __future__ import annotations

import json

import aten_ops
import pytest

BASELINE_PATH = aten_ops.baseline_path()
if not BASELINE_PATH.exists():
    pytest.skip(
        f"no recorded aten ops for {BASELINE_PATH.name}", allow_module_level=True
    )
BASELINE = json.loads(BASELINE_PATH.read_text())
VERSIONS = aten_ops.versions()
RECORDED_WITH = {key: BASELINE[key] for key in ("torch", "tensordict")}
INSTALLED = {key: VERSIONS[key] for key in RECORDED_WITH}
CALLS = aten_ops.calls()


@pytest.mark.skipif(
    RECORDED_WITH != INSTALLED, reason=f"recorded with {RECORDED_WITH}, not {INSTALLED}"
)
@pytest.mark.parametrize("case", sorted(BASELINE["cases"]))
def test_keep_keys_off_runs_stock_aten_ops(case):
    assert case in CALLS, f"{case} was recorded but the suite no longer has it"
    assert aten_ops.digest(CALLS[case]) == BASELINE["cases"][case]
