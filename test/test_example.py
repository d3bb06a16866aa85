"""Smoke test of ``examples/ppo_pendulum_keep_keys.py``.

The example is run as a user would run it, in a subprocess whose cwd is a
temporary directory, with a few hundred frames: it must train both runs
through ``ClipPPOLoss`` with ``keep_keys`` against the installed torchrl, time
keep_keys against the second-pass workaround, exit cleanly, and write its plot
and JSON summary where it was told to, and nowhere else.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ppo_pendulum_keep_keys.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _repo_outputs() -> set[str]:
    """PNG and JSON files in the repository, ignored ones included.

    Only the kinds of files the example writes: others may edit the checkout
    while the test runs.
    """
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return {f for f in files if f.endswith((".png", ".json"))}


def test_ppo_pendulum_keep_keys_example(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "out"
    outputs_before = _repo_outputs()
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--frames",
            "400",
            "--frames-per-batch",
            "200",
            # one pendulum: an episode (200 steps) ends in every batch
            "--num-envs",
            "1",
            "--epochs",
            "2",
            "--minibatch",
            "50",
            "--timed-updates",
            "10",
            "--seed",
            "1",
            "--out",
            str(out),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    png = out / "ppo_pendulum_keep_keys.png"
    summary_path = out / "ppo_pendulum_keep_keys.json"
    assert sorted(p.name for p in out.iterdir()) == [summary_path.name, png.name]
    assert png.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    assert png.stat().st_size > 20_000  # a 4-panel figure, not an empty canvas
    assert str(png) in result.stdout and str(summary_path) in result.stdout

    summary = json.loads(summary_path.read_text())
    runs = summary["runs"]
    assert set(runs) == {"baseline", "aux"}
    for run in runs.values():
        assert run["frames"] == 400
        assert math.isfinite(run["final_return"])
        assert 0.0 <= run["final_dead_fraction"] <= 1.0
        assert len(run["history"]["dead"]) == 2  # one entry per batch
    assert runs["baseline"]["aux_coef"] == 0.0 and runs["aux"]["aux_coef"] > 0
    # same seed, same data budget: only the auxiliary loss tells them apart
    assert runs["aux"]["final_dead_fraction"] != runs["baseline"]["final_dead_fraction"]

    timing = summary["timing"]
    assert timing["updates"] == 10 and timing["threads"] == 1
    assert timing["same_gradients"] is True
    for key in ("keep_keys_ms_median", "second_pass_ms_median"):
        assert isinstance(timing[key], float) and timing[key] > 0
    ratio = timing["ratio_second_pass_over_keep_keys"]
    assert math.isclose(
        ratio, timing["second_pass_ms_median"] / timing["keep_keys_ms_median"]
    )

    # nothing written to the cwd or the repository
    assert list(cwd.iterdir()) == []
    assert _repo_outputs() == outputs_before
