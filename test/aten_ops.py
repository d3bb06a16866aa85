"""The aten ops that losses and value estimators run with ``keep_keys`` off.

KEEP_KEYS.md asks that with ``keep_keys`` off every loss and estimator runs
upstream's aten ops. ``test_keep_keys_off.py`` holds the patched torchrl to the
ops that stock torchrl runs, recorded by this script into
``baselines/aten-ops/torchrl-<version>.json``, one digest per case: each loss
case of ``test_keep_keys.py`` (its ``forward``) and each value estimator on each
call path, with and without functional parameters. To record them again, run
this file with the stock wheel first on the path (CONTRIBUTING.md shows how).
"""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import sys

import tensordict
import torch
import torchrl
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import test_keep_keys as suite

BASELINES = pathlib.Path(__file__).parents[1] / "baselines" / "aten-ops"


class _OpLog(TorchDispatchMode):
    """Records the name of every aten op that runs under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def versions() -> dict:
    """The versions the ops depend on; the torchrl one without a local label.

    The packages' own ``__version__``, which each reads from its distribution,
    the nightly's included.
    """
    return {
        "torchrl": torchrl.__version__.split("+")[0],
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
    }


def baseline_path() -> pathlib.Path:
    return BASELINES / f"torchrl-{versions()['torchrl']}.json"


def _loss_call(make_case):
    case = make_case()
    torch.manual_seed(0)
    loss, data = case.make_loss(), case.data()  # keep_keys never set
    return functools.partial(suite._run, loss, data)


def _estimator_call(name, path, functional):
    value_net, data, kwargs = suite._estimator_inputs(name, functional)
    estimator = suite._estimator(name, value_net, None, **suite.PATHS[path])
    return functools.partial(estimator, data, **kwargs)


def calls() -> dict:
    """Each case's name, and what builds its call (built outside the log)."""
    cases = {
        f"loss/{name}": functools.partial(_loss_call, make_case)
        for name, make_case in suite.LOSS_CASES.items()
    }
    for name in suite.ESTIMATORS:
        for path in suite.PATHS:
            for functional in (False, True):
                if suite._unsupported_path(name, path, functional):
                    continue
                case = f"estimator/{name}/{path}" + "/functional" * functional
                cases[case] = functools.partial(_estimator_call, name, path, functional)
    return cases


def digest(build) -> dict:
    """How many aten ops the built call runs, and a digest of their sequence."""
    call = build()
    with _OpLog() as log:
        call()
    ops = "\n".join(log.ops).encode()
    return {"ops": len(log.ops), "sha256": hashlib.sha256(ops).hexdigest()}


def main() -> None:
    recorded = {}
    for name, build in calls().items():
        try:
            recorded[name] = digest(build)
        except Exception as error:  # a case stock cannot run is not compared
            print(f"{name}: not recorded ({type(error).__name__}: {error})")
    BASELINES.mkdir(parents=True, exist_ok=True)
    baseline, path = {**versions(), "cases": recorded}, baseline_path()
    path.write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    print(f"{len(recorded)} cases -> {path}")


if __name__ == "__main__":
    main()
