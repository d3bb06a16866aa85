"""Run upstream's linters on the queue's patched files and report only new findings.

Usage: ``python -m torchrl_fork.lint [--base NAME] [TOOL ...]`` with TOOL among
ufmt, flake8, pydocstyle, pyupgrade and codespell (default: all), on the queue
of base NAME (default: every base whose queue exists). Each file the series
touches is linted in the queue and, for files upstream already has, in the
pristine base too; a finding counts only if the base does not have it.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from torchrl_fork.base import Pin
from torchrl_fork.gitcmd import git, git_blob
from torchrl_fork.series import BASE_TAG

#: upstream pytorch/rl's settings (setup.cfg), as command-line options.
FLAKE8 = [
    "--max-line-length=79",
    "--extend-ignore=E203,E402,W503,W504,E501,E231",
    "--per-file-ignores=test_*.py:F841,E731,E266",
]
PYDOCSTYLE = ["--convention=google", "--add-ignore=D100,D104,D105,D107,D102,D417"]
TOOLS = {
    "ufmt": lambda paths: ["ufmt", "check", *paths],
    "flake8": lambda paths: ["flake8", *FLAKE8, *paths],
    "pydocstyle": lambda paths: [
        "pydocstyle",
        *PYDOCSTYLE,
        *[p for p in paths if "torchrl/" in p],
    ],
    "pyupgrade": lambda paths: ["pyupgrade", "--py311-plus", *paths],
    "codespell": lambda paths: ["codespell", *paths],
}
LINE_NUMBER = re.compile(r":\d+(:\d+)?|line \d+")


def series_files(queue: Path) -> list[str]:
    """Python files that differ between the queue's base and its head."""
    out = git("diff", "--name-only", f"{BASE_TAG}..HEAD", cwd=queue).stdout
    return [p for p in out.splitlines() if p.endswith(".py")]


def findings(tool: str, root: Path, paths: list[str]) -> Counter[str]:
    """The tool's complaints about ``paths`` (relative to ``root``), line numbers dropped."""
    paths = [p for p in paths if (root / p).exists()]
    if not paths:
        return Counter()
    if tool == "pyupgrade":
        return _pyupgrade(root, paths)
    if tool == "ufmt":
        return _ufmt(root, paths)
    result = subprocess.run(
        TOOLS[tool](paths), cwd=root, capture_output=True, text=True
    )
    output = (result.stdout + result.stderr).replace(f"{root}/", "")
    lines = [line for line in output.splitlines() if "\u2728" not in line]
    if tool == "pydocstyle":
        # pydocstyle prints "path:line in ..." then the code on the next line
        lines = [a + b for a, b in zip(lines[::2], lines[1::2])]
    return Counter(LINE_NUMBER.sub("", line).strip() for line in lines if line.strip())


#: upstream's pyproject.toml setting: usort sorts without guessing first-party
#: packages, so a file sorts the same wherever it lies
USORT_CONFIG = "[tool.usort]\nfirst_party_detection = false\n"


def _ufmt(root: Path, paths: list[str]) -> Counter[str]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_text(USORT_CONFIG)
        for path in paths:
            (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / path).write_bytes((root / path).read_bytes())
        result = subprocess.run(
            TOOLS["ufmt"](paths), cwd=tmp, capture_output=True, text=True
        )
        output = (result.stdout + result.stderr).replace(f"{tmp}/", "")
    lines = [line for line in output.splitlines() if "\u2728" not in line]
    return Counter(line.strip() for line in lines if line.strip())


def _pyupgrade(root: Path, paths: list[str]) -> Counter[str]:
    changed = Counter()
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / Path(path).name
            copy.write_bytes((root / path).read_bytes())
            result = subprocess.run(["pyupgrade", "--py311-plus", str(copy)])
            if result.returncode:
                changed[f"{path}: pyupgrade --py311-plus would rewrite it"] += 1
    return changed


def new_findings(tool: str, queue: Path) -> list[str]:
    paths = series_files(queue)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for path in paths:
            try:
                blob = git_blob(queue, BASE_TAG, path)
            except subprocess.CalledProcessError:
                continue  # a file the series adds
            (base / path).parent.mkdir(parents=True, exist_ok=True)
            (base / path).write_bytes(blob)
        before = findings(tool, base, paths)
    after = findings(tool, queue, paths)
    return sorted((after - before).elements())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrl_fork.lint")
    parser.add_argument("--base", choices=Pin.names(), action="append")
    parser.add_argument("tools", nargs="*", metavar="TOOL", help=", ".join(TOOLS))
    args = parser.parse_args(argv)
    tools = args.tools or list(TOOLS)
    queues = [Pin.load(name).queue_dir for name in args.base or Pin.names()]
    queues = [queue for queue in queues if (queue / ".git").exists()]
    if not queues:
        print("no queue to lint; run 'python -m torchrl_fork import' first")
        return 1
    status = 0
    for queue in queues:
        for tool in tools:
            new = new_findings(tool, queue)
            for line in new:
                print(f"{queue.name}: {tool}: {line}")
            status |= bool(new)
        if not status:
            print(
                f"{queue.name}: {', '.join(tools)}: nothing new in "
                f"{len(series_files(queue))} files"
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
