"""Smoke test of ``examples/ppo_pendulum_keep_keys.py``.

The example is run as a user would run it, in a subprocess, with a few hundred
frames: it must train through ``ClipPPOLoss`` with ``keep_keys`` against the
installed torchrl, exit cleanly and write its plot.
"""

import subprocess
import sys
from pathlib import Path

EXAMPLE = (
    Path(__file__).resolve().parent.parent / "examples" / "ppo_pendulum_keep_keys.py"
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ppo_pendulum_keep_keys_example(tmp_path):
    plot = tmp_path / "stats.png"
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--frames",
            "400",
            "--frames-per-batch",
            "200",
            "--epochs",
            "2",
            "--minibatch",
            "50",
            "--seed",
            "1",
            "--plot",
            str(plot),
        ],
        # the example writes nothing but its plot: run it where litter is harmless
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert plot.is_file() and plot.stat().st_size > 0
    assert plot.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    assert "400 frames" in result.stdout
