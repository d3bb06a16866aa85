"""Print the keep_keys benchmark table: ``python benchmarks/report.py [--stock]``.

1. Runs ``test_keep_keys_benchmarks.py`` under pytest-benchmark in this
   environment (the fork). Every round there times all modes of a case side
   by side; the table gives the medians of the per-round ratios: on/off,
   workaround/on (both with the auxiliary loss) and the extractors' share.
2. With ``--stock``, times keep_keys-off steps of the fork and of stock
   torchrl 0.14.1 in separate processes, interleaved, on the same input.
   Stock torchrl is installed into ``build/stock-venv`` on first use; torch
   and tensordict come from this environment.
3. Measures memory: bytes saved for backward with keep_keys on and off, and
   whether each kept tensor shares storage with the feature extractor's output.
4. Runs ``test_keep_keys_host_time.py``: the host time keep_keys adds to one
   loss call with tiny networks, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import site
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STOCK_VENV = ROOT / "build" / "stock-venv"
sys.path.insert(0, str(HERE))

from keep_keys_cases import CASES, LAYOUT_CASES, MODES  # noqa: E402


def run_pytest_benchmark(name: str = "test_keep_keys_benchmarks.py") -> dict[str, dict]:
    """Run the benchmarks of the file ``name``; ``{case name: extra_info}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                # one process: pytest-benchmark disables itself under xdist,
                # which this repository's pytest.ini turns on
                "-o",
                "addopts=",
                "-p",
                "no:xdist",
                str(HERE / name),
                f"--benchmark-json={out}",
                "--benchmark-disable-gc",
            ],
            check=True,
            cwd=HERE,
            stdout=subprocess.DEVNULL,
        )
        data = json.loads(out.read_text())
    return {bench["param"]: bench["extra_info"] for bench in data["benchmarks"]}


TIMER = """
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import torchrl
from keep_keys_cases import CASES
out = {{"torchrl": torchrl.__version__}}
for cls in CASES:
    case = cls()
    case.step("off")
    times = []
    for _ in range({repeat}):
        start = time.perf_counter()
        case.step("off")
        times.append(time.perf_counter() - start)
    out[cls.name] = statistics.median(times)
print(json.dumps(out))
"""


def stock_python() -> Path:
    python = STOCK_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(STOCK_VENV)], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-deps", "torchrl==0.14.1"],
            check=True,
        )
        # torch and tensordict from this environment, after stock torchrl
        (site_dir,) = STOCK_VENV.glob("lib/python*/site-packages")
        (site_dir / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def compare_with_stock(rounds: int, repeat: int) -> dict[str, float]:
    """Median over rounds of (fork, keep_keys off) / (stock), processes interleaved."""
    pythons = {"fork": Path(sys.executable), "stock": stock_python()}
    code = TIMER.format(here=str(HERE), repeat=repeat)
    ratios: dict[str, list[float]] = {}
    versions = {}
    for i in range(rounds):
        results = {}
        for name in ("fork", "stock") if i % 2 == 0 else ("stock", "fork"):
            out = subprocess.run(
                [pythons[name], "-c", code],
                check=True,
                capture_output=True,
                text=True,
                cwd=tempfile.gettempdir(),
            ).stdout
            results[name] = json.loads(out.splitlines()[-1])
            versions[name] = results[name].pop("torchrl")
        for case, fork_time in results["fork"].items():
            ratios.setdefault(case, []).append(fork_time / results["stock"][case])
    if versions["stock"] != "0.14.1" or "keepkeys" not in versions["fork"]:
        raise RuntimeError(f"unexpected torchrl versions: {versions}")
    return {case: statistics.median(values) for case, values in ratios.items()}


CALLGRIND = """
import os, sys
from torch.utils.benchmark import Timer
setup = (
    "import os, sys; os.environ['RL_WARNINGS'] = '0'; sys.path.insert(0, {here!r}); "
    "import keep_keys_cases as k; cases = [cls() for cls in k.CASES]; "
    "[c.step('off') for c in cases]"
)
timer = Timer(stmt="[c.step('off') for c in cases]", setup=setup)
print(timer.collect_callgrind(number=2, collect_baseline=False).counts(denoise=True))
"""


def _callgrind(python: Path, code: str) -> int:
    """The instruction count that ``code`` (a ``CALLGRIND`` script) prints."""
    # callgrind runs the interpreter found first on PATH
    env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True, env=env
    ).stdout
    return int(out.split()[-1])


def count_instructions() -> dict[str, int]:
    """Instructions of two keep_keys-off steps of every case, for fork and stock.

    Counted by valgrind's callgrind through ``torch.utils.benchmark``; unlike
    time, the count does not depend on the machine's load.
    """
    code = CALLGRIND.format(here=str(HERE))
    return {
        name: _callgrind(python, code)
        for name, python in (("fork", Path(sys.executable)), ("stock", stock_python()))
    }


CALLGRIND_HOST = """
from torch.utils.benchmark import Timer
setup = (
    "import sys; sys.path.insert(0, {here!r}); "
    "import torch, test_keep_keys_host_time as h; torch.set_num_threads(1); "
    "torch.manual_seed(0); loss, keep = h.CASES[{case!r}](); "
    "loss.set_keys(keep_keys=keep if {on} else None); data = h._data(); "
    "[loss(data.clone()) for _ in range(3)]"
)
timer = Timer(stmt="loss(data.clone())", setup=setup)
print(timer.collect_callgrind(number=10, collect_baseline=False).counts(denoise=True))
"""


def count_host_instructions() -> dict[str, dict[str, int]]:
    """Instructions of ten tiny loss calls per case, keep_keys off and on.

    The host time cases of ``test_keep_keys_host_time.py``, counted by
    callgrind, which resolves differences of 1 % that time on a shared
    machine cannot.
    """
    from test_keep_keys_host_time import CASES as HOST_CASES

    counts = {}
    for case in HOST_CASES:
        for on in (False, True):
            code = CALLGRIND_HOST.format(here=str(HERE), case=case, on=on)
            count = _callgrind(Path(sys.executable), code)
            counts.setdefault(case, {})["on" if on else "off"] = count
    return counts


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    # outputs computed under vmap are wrappers around the real tensor
    while torch._C._functorch.is_batchedtensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def memory(case) -> dict[str, object]:
    """Bytes saved for backward with keep_keys off and on, and storage sharing.

    A kept tensor shares storage with the network's output when its data
    pointer is the one of a tensor that a feature extractor returned.
    """

    def saved_bytes(mode):
        storages = {}

        def pack(tensor):
            ptr = _storage_ptr(tensor)
            if ptr is not None:
                storages[ptr] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            td = case.step(mode)
        return sum(storages.values()), td

    outputs = set()

    def record(module, args, output):
        for key in module.out_keys:
            ptr = _storage_ptr(output.get(key))
            if ptr is not None:
                outputs.add(ptr)

    off_bytes, _ = saved_bytes("off")
    hooks = [ex.register_forward_hook(record) for ex in case.extractors]
    try:
        on_bytes, td = saved_bytes("on")
    finally:
        for hook in hooks:
            hook.remove()
    shared, copied = [], []
    for key in case.keep:
        for place in (key, ("next", key)):
            value = td.get(place, None)
            if value is not None:
                (shared if _storage_ptr(value) in outputs else copied).append(place)
    return {"off": off_bytes, "on": on_bytes, "shared": shared, "copied": copied}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "no graph"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stock", action="store_true", help="also compare with stock 0.14.1"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions, fork vs stock, with valgrind (slow)",
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, {platform.machine()}, "
        f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}"
    )
    results = run_pytest_benchmark()
    stock = compare_with_stock(args.rounds, args.repeat) if args.stock else {}
    print(
        "| case | on/off (≤ 1.03) | workaround/on (≥ 1 + share) | extractors' share "
        "| off/stock (≤ 1.01) | saved for backward, on/off | kept tensors sharing storage |"
    )
    print("|" + " --- |" * 7)
    for cls in CASES:
        ratios = results[cls.name]["ratios"]
        share = ratios["extractors' share"]
        mem = memory(cls())
        stock_ratio = f"{stock[cls.name]:.3f}" if cls.name in stock else "not run"
        sharing = f"{len(mem['shared'])}/{len(mem['shared']) + len(mem['copied'])}"
        print(
            f"| {cls.name} | {ratios['on/off']:.3f} "
            f"| {ratios['workaround/on']:.3f} (≥ {1 + share:.3f}) | {share:.3f} "
            f"| {stock_ratio} | {_ratio(mem['on'], mem['off'])} | {sharing} |"
        )
    print()
    print("| case | " + " | ".join(f"{mode} (ms)" for mode in MODES) + " |")
    print("|" + " --- |" * (len(MODES) + 1))
    for cls in CASES:
        medians = results[cls.name]["median_s"]
        cells = " | ".join(f"{medians[mode] * 1e3:.1f}" for mode in MODES)
        print(f"| {cls.name} | {cells} |")
    print()
    print(
        "| case (tiny networks, one thread), step | host time keep_keys adds (≤ 50 µs a call) |"
    )
    print("| --- | --- |")
    for name, info in run_pytest_benchmark("test_keep_keys_host_time.py").items():
        print(f"| {name} | {info['added_us']:.0f} µs |")
    if args.instructions:
        print(
            "\n| case (tiny networks) | instructions per 10 calls, off | on | on/off (≤ 1.012) |"
        )
        print("| --- | --- | --- | --- |")
        for name, count in count_host_instructions().items():
            print(
                f"| {name} | {count['off']:,} | {count['on']:,} "
                f"| {count['on'] / count['off']:.4f} |"
            )
        counts = count_instructions()
        print(
            f"\ninstructions of two keep_keys-off steps of every case: fork "
            f"{counts['fork']:,}, stock {counts['stock']:,}, "
            f"fork / stock {counts['fork'] / counts['stock']:.4f} (≤ 1.01)"
        )
    print()
    print("| estimator path | kept tensors sharing storage with the network output |")
    print("| --- | --- |")
    for cls in LAYOUT_CASES:
        mem = memory(cls())
        total = len(mem["shared"]) + len(mem["copied"])
        print(f"| {cls.name} | {len(mem['shared'])}/{total} |")


if __name__ == "__main__":
    main()
