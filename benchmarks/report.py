"""Print the keep_keys benchmark table: ``python benchmarks/report.py``.

1. Runs ``test_keep_keys_benchmarks.py`` under pytest-benchmark in this
   environment (the fork) and turns the medians into ratios: on/off,
   workaround/on (both with the auxiliary loss), and the extractors' share.
2. With ``--stock``, times keep_keys-off steps of the fork and of stock
   torchrl 0.14.1 in separate processes, interleaved, on the same input.
   Stock torchrl is installed into ``build/stock-venv`` on first use; torch
   and tensordict come from this environment.
3. Measures memory: bytes saved for backward with keep_keys on and off, and
   whether each kept tensor shares storage with a tensor of the graph.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STOCK_VENV = ROOT / "build" / "stock-venv"
sys.path.insert(0, str(HERE))


def run_pytest_benchmark() -> dict[str, dict[str, float]]:
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
                str(HERE / "test_keep_keys_benchmarks.py"),
                f"--benchmark-json={out}",
                "--benchmark-disable-gc",
            ],
            check=True,
            cwd=HERE,
            stdout=subprocess.DEVNULL,
        )
        data = json.loads(out.read_text())
    medians: dict[str, dict[str, float]] = {}
    for bench in data["benchmarks"]:
        medians.setdefault(bench["group"], {})[bench["extra_info"]["mode"]] = bench[
            "stats"
        ]["median"]
    return medians


def extractor_share(case) -> float:
    """Median time of the extractors' own forward + backward, over the ``on_aux`` step."""
    from keep_keys_cases import aux_loss

    def extractors_only():
        aux_loss(case.refeaturize(case.data.clone())).backward()
        case.module.zero_grad(set_to_none=True)

    return _median_time(extractors_only), _median_time(lambda: case.step("on_aux"))


def _median_time(fn, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


TIMER = """
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import torch, torchrl
from keep_keys_cases import CASES
torch.set_num_threads({threads})
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
        import site

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
    """Median over rounds of (fork off) / (stock), processes interleaved."""
    pythons = {"fork": Path(sys.executable), "stock": stock_python()}
    code = TIMER.format(here=str(HERE), threads=torch.get_num_threads(), repeat=repeat)
    ratios: dict[str, list[float]] = {}
    versions = {}
    for i in range(rounds):
        results = {}
        order = ["fork", "stock"] if i % 2 == 0 else ["stock", "fork"]
        for name in order:
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
    assert versions["stock"] == "0.14.1" and "keepkeys" in versions["fork"], versions
    return {case: statistics.median(values) for case, values in ratios.items()}


def memory(case) -> dict[str, object]:
    """Bytes saved for backward, keep_keys off and on, and storage sharing of kept tensors."""

    def saved_bytes(mode):
        storages = {}

        def pack(tensor):
            try:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                pass  # tensors inside vmap have no storage of their own
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            td = case.step(mode)
        return sum(storages.values()), storages, td

    off_bytes, _, _ = saved_bytes("off")
    on_bytes, storages, td = saved_bytes("on")
    shared, copied = [], []
    for key in case.keep:
        for place, value in ((key, td.get(key)), (("next", key), td.get(("next", key), None))):
            if value is None:
                continue
            ptr = value.untyped_storage().data_ptr()
            (shared if ptr in storages else copied).append(place)
    return {"off": off_bytes, "on": on_bytes, "shared": shared, "copied": copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", action="store_true", help="also compare with stock 0.14.1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    from keep_keys_cases import CASES

    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}"
    )
    medians = run_pytest_benchmark()
    stock = compare_with_stock(args.rounds, args.repeat) if args.stock else {}
    header = (
        "| case | on/off (≤ 1.03) | workaround/on (≥ 1 + share) | extractors' share "
        "| off/stock (≤ 1.01) | saved-for-backward on/off | kept tensors sharing storage |"
    )
    print(header)
    print("|" + " --- |" * 7)
    for cls in CASES:
        case = cls()
        m = medians[cls.name]
        extractors, step = extractor_share(case)
        share = extractors / step
        mem = memory(case)
        on_off = m["on"] / m["off"]
        work_on = m["workaround_aux"] / m["on_aux"]
        stock_ratio = f"{stock[cls.name]:.3f}" if cls.name in stock else "not run"
        sharing = f"{len(mem['shared'])}/{len(mem['shared']) + len(mem['copied'])}"
        if mem["copied"]:
            sharing += f" (copied: {', '.join(map(str, mem['copied']))})"
        print(
            f"| {cls.name} | {on_off:.3f} | {work_on:.3f} (≥ {1 + share:.3f}) | {share:.3f} "
            f"| {stock_ratio} | {mem['on'] / max(mem['off'], 1):.3f} | {sharing} |"
        )


if __name__ == "__main__":
    main()
