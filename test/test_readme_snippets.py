"""The README's code runs as shown, and the README quotes its test command's count.

* ``test_readme_python_block_runs``: every ```python block of ``README.md``
  runs as a script of its own, in a fresh interpreter (``sys.executable``,
  whatever torchrl it imports) whose cwd is a temporary directory, and exits
  with status 0. A block therefore defines everything it uses.
* ``test_readme_quotes_the_test_count``: the README's sentence "It collects N
  tests" gives the number of tests that the README's test command,
  ``python -m pytest`` from the repository root (``pytest.ini``: not ``slow``),
  collects. When tests are added or removed, update N in that sentence.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from torchrl_fork import ROOT

README = ROOT / "README.md"
# a block starts with a line "```python" and ends at the next line "```"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
# the README's sentence that quotes the count
COUNT_SENTENCE = re.compile(r"It\s+collects\s+(\d+)\s+tests")
# pytest -q --collect-only ends with "N tests collected" or, with
# deselected tests, "N/M tests collected (K deselected)"
COLLECTED = re.compile(r"^(\d+)(?:/\d+)? tests? collected", re.M)


def readme_blocks() -> list[pytest.param]:
    readme = README.read_text()
    blocks = []
    for match in BLOCK.finditer(readme):
        line = readme[: match.start()].count("\n") + 1  # the opening fence's
        blocks.append(pytest.param(match.group(1), id=f"line{line}"))
    return blocks


def test_readme_has_python_blocks():
    assert readme_blocks(), "README.md has no ```python block"


@pytest.mark.parametrize("code", readme_blocks())
def test_readme_python_block_runs(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{code}\n{result.stdout}{result.stderr}"


def test_readme_quotes_the_test_count():
    quoted = COUNT_SENTENCE.findall(README.read_text())
    assert (
        len(quoted) == 1
    ), f"README.md must say {COUNT_SENTENCE.pattern!r} exactly once, found {quoted}"
    # the README's command, collecting only
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = COLLECTED.findall(result.stdout)
    assert result.returncode == 0 and len(collected) == 1, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
    assert int(collected[0]) == int(quoted[0]), (
        f"`python -m pytest` collects {collected[0]} tests; README.md says "
        f"{quoted[0]}: update the sentence 'It collects N tests' in README.md"
    )
