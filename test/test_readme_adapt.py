"""The README's "Adapt your script" block runs as written, and its auxiliary term trains the extractor.

The block is the fenced code after the ``<!-- adapt-your-script -->`` marker.
It uses a user's ``actor`` and ``batch``, which this test supplies.
"""

import re

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, TanhNormal

from torchrl_fork import ROOT

MARKER = "<!-- adapt-your-script -->"


def readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(MARKER) == 1
    match = re.match(r"\s*```python\n(.*?)^```$", readme.split(MARKER)[1], re.S | re.M)
    assert match, f"no ```python block right after {MARKER}"
    return match.group(1)


def _user_actor_and_batch(n=32):
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(nn.Linear(3, 2), NormalParamExtractor()),
            ["observation"],
            ["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    with torch.no_grad():
        batch = actor(TensorDict(observation=torch.randn(n, 3), batch_size=[n]))
    done = torch.zeros(n, 1, dtype=torch.bool)
    batch["next"] = TensorDict(
        observation=torch.randn(n, 3),
        reward=torch.randn(n, 1),
        done=done,
        terminated=done,
        batch_size=[n],
    )
    return actor, batch


def _leaves(tensor):
    """Every parameter that ``tensor``'s graph reaches."""
    seen, stack, leaves = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def test_readme_adapt_block_trains_the_extractor_through_the_aux_term():
    torch.manual_seed(0)
    actor, batch = _user_actor_and_batch()
    namespace = {"actor": actor, "batch": batch}
    exec(readme_block(), namespace)
    extractor = namespace["extractor"]
    # the auxiliary term alone reaches every parameter of the extractor
    assert {id(p) for p in extractor.parameters()} <= _leaves(namespace["aux"])
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in extractor.parameters()
    )
