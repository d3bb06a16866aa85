"""The keep_keys section the series adds to upstream's docs runs as written.

The section is all new lines of the docs patch, so its code blocks are read
from the patch itself and run against the installed fork, in order, in one
namespace, as a reader would paste them.
"""

import re
import textwrap

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.docs import docs_patch, REFERENCE, reference_text, section


# The section's example leaves DQN's target-network updater out, to stay short;
# torchrl warns about that on every loss call.
@pytest.mark.filterwarnings("ignore:No target network updater has been associated")
@pytest.mark.parametrize("base", Pin.names())
def test_docs_section_code_runs(base):
    text = "\n".join(section(docs_patch(Pin.load(base)))) + "\n"
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?: {4}.*)?\n)+)", text)
    assert len(blocks) == 1
    assert len(text.strip().splitlines()) <= 110
    # the CUDA-graph advice needs a compiled update on a GPU: it is read, not run
    assert "CudaGraphModule" in text and "clone what you read" in text
    namespace = {}
    exec(textwrap.dedent(blocks[0]), namespace)
    data = namespace["data"]
    # the loss's own call of the extractor, kept with its graph
    assert data["features"].requires_grad
    assert data["features"].shape == (16, 8)
    assert not data["next", "features"].requires_grad
    # the prose's way to turn the feature off
    assert "loss.set_keys(keep_keys=None)" in text
    namespace["loss"].set_keys(keep_keys=None)
    assert namespace["loss"].tensor_keys.keep_keys == []


def test_reference_file_is_the_series_section():
    """``docs/KEEP_KEYS_REFERENCE.rst`` is what ``python -m torchrl_fork docs`` writes now."""
    assert (
        REFERENCE.read_text() == reference_text()
    ), "docs/KEEP_KEYS_REFERENCE.rst is stale: run `python -m torchrl_fork docs`"
