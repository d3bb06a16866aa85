"""The keep_keys section the series adds to upstream's docs runs as written.

The section is all new lines of the docs patch, so its code blocks are read
from the patch itself and run against the installed fork, in order, in one
namespace, as a reader would paste them.
"""

import re
import textwrap

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.series import is_docs_patch, series_paths

SECTION = ".. _ref_keep_keys:"


def _added_lines(patch, path):
    """The lines ``patch`` adds to ``path``, without their ``+``."""
    text = patch.read_text()
    block = text.split(f"diff --git a/{path} b/{path}\n", 1)[1].split(
        "\ndiff --git", 1
    )[0]
    return [
        line[1:]
        for line in block.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


@pytest.mark.parametrize("base", Pin.names())
def test_docs_section_code_runs(base):
    (patch,) = [p for p in series_paths(Pin.load(base).patches_dir) if is_docs_patch(p)]
    lines = _added_lines(patch, "docs/source/reference/objectives_common.rst")
    section = "\n".join(lines[lines.index(SECTION) :]) + "\n"
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?: {4}.*)?\n)+)", section)
    assert len(blocks) == 2
    assert len(section.strip().splitlines()) <= 60
    # the CUDA-graph advice needs a compiled update on a GPU: it is read, not run
    assert section.count(".clone()") == 2
    namespace = {}
    for block in blocks:
        exec(textwrap.dedent(block), namespace)
    data = namespace["data"]
    # the loss's own call of the extractor, kept with its graph
    assert data["features"].requires_grad
    assert data["features"].shape == (16, 8)
    assert not data["next", "features"].requires_grad
    # the last block turns the feature off
    assert namespace["loss"].tensor_keys.keep_keys == []
