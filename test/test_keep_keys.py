"""``keep_keys`` in depth: the behaviour suite of the patched torchrl, on both bases.

This is the repository's own test of the series, not a file of the series: the
series adds compact tests to upstream's test classes (``test_values.py``,
``test_loss_module.py``, one test per ``Test<Loss>`` class), which need
upstream's test tree; this file needs only the installed torchrl, so CI runs it
on torchrl 0.14.1+keepkeys and on the patched torchrl-nightly. The losses that
only upstream main has (FQL, TransitiveQ, TD-MPC2, the reward model) skip on
0.14.1.

Every network starts with a feature extractor whose output the tests keep, and
every kept entry is checked against a direct call of the network on the stored
data, or against the same call with ``keep_keys`` off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sys
import threading

import pytest
import torch
from tensordict import lazy_stack, TensorDict, unravel_key
from tensordict.nn import (
    NormalParamExtractor,
    set_skip_existing,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
)
from torch import nn
from torch._dynamo.utils import counters
from torchrl.modules import (
    ActorValueOperator,
    BatchRenorm1d,
    DistributionalQValueActor,
    LSTMModule,
    ProbabilisticActor,
    QValueActor,
    TanhNormal,
    WorldModel,
)
from torchrl.objectives import (
    A2CLoss,
    ACTLoss,
    BCLoss,
    ClipPPOLoss,
    CQLLoss,
    CrossQLoss,
    DDPGLoss,
    DiscreteCQLLoss,
    DiscreteIQLLoss,
    DiscreteSACLoss,
    DistributionalDQNLoss,
    DQNLoss,
    DTLoss,
    ExponentialQuadraticCost,
    GAILLoss,
    IQLLoss,
    KLPENPPOLoss,
    LossModule,
    OnlineDTLoss,
    PPOLoss,
    REDQLoss,
    ReinforceLoss,
    SACLoss,
    TD3BCLoss,
    TD3Loss,
    TQCLoss,
    WorldModelLoss,
)
from torchrl.objectives.llm import DistillationLoss, SFTLoss
from torchrl.objectives.multiagent import IPPOLoss, MAPPOLoss, QMixerLoss
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import (
    GAE,
    MultiAgentGAE,
    TD0Estimator,
    TD1Estimator,
    TDLambdaEstimator,
    VTrace,
)
from torchrl.testing import get_default_devices

try:  # losses that upstream main has and torchrl 0.14.1 lacks
    from torchrl.modules import (
        FlowMatchingPolicy,
        IndependentNormal,
        OneStepPolicy,
        TdMpc2QEnsemble,
    )
    from torchrl.modules.models.tdmpc2 import _TdMpc2PolicyPrior
    from torchrl.objectives import FQLLoss, TdMpc2Loss, TransitiveQLoss
    from torchrl.objectives.llm import RewardModelLoss

    MAIN_LOSSES = True
except ImportError:
    MAIN_LOSSES = False
main_only = pytest.mark.skipif(not MAIN_LOSSES, reason="a loss of upstream main only")

OBS_DIM, ACT_DIM, FEAT_DIM, N_ACTIONS = 3, 2, 4, 3
BATCH, TIME = 4, 6


def _linear_module(in_key, out_key, in_features, out_features):
    return TensorDictModule(
        nn.Linear(in_features, out_features), in_keys=[in_key], out_keys=[out_key]
    )


def _trunk_head(feature_key, out_key, out_features=1, obs_key="obs"):
    """A feature extractor followed by a head."""
    return TensorDictSequential(
        _linear_module(obs_key, feature_key, OBS_DIM, FEAT_DIM),
        _linear_module(feature_key, out_key, FEAT_DIM, out_features),
    )


def _value_network(feature_key="hidden", value_key="state_value"):
    return _trunk_head(feature_key, value_key)


def _rollout(batch=BATCH, time=TIME, device="cpu", done_at=(), terminated=True):
    """Rollout-like data shaped ``[B, T]``, with the time dim named ``"time"``."""
    obs = torch.randn(batch, time + 1, OBS_DIM)
    done = torch.zeros(batch, time, 1, dtype=torch.bool)
    done[:, list(done_at)] = True
    data = TensorDict(
        obs=obs[:, :-1].clone(),
        action=torch.randint(2, (batch, time)),
        sample_log_prob=torch.randn(batch, time),
        next={
            "obs": obs[:, 1:].clone(),
            "reward": torch.randn(batch, time, 1),
            "done": done,
            "terminated": done.clone() if terminated else torch.zeros_like(done),
        },
        batch_size=[batch, time],
    )
    return data.refine_names(..., "time").to(device)


def _keys(tensordict):
    return set(tensordict.keys(True, True))


def _as_tuple(key):
    return (key,) if isinstance(key, str) else key


def _assert_same_entries(tensordict, reference):
    """Same keys, and each entry equal to the reference's."""
    assert _keys(tensordict) == _keys(reference)
    for key in _keys(reference):
        torch.testing.assert_close(
            tensordict.get(key), reference.get(key), rtol=0, atol=0, equal_nan=True
        )


@contextlib.contextmanager
def _linear_calls():
    """Counts the calls of every ``nn.Linear`` while the context is open."""
    counter = {"calls": 0}

    def hook(module, args):
        counter["calls"] += isinstance(module, nn.Linear)

    with torch.nn.modules.module.register_module_forward_pre_hook(hook):
        yield counter


def _direct(network, tensordict, params=None):
    """What ``network`` writes when called on ``tensordict`` itself."""
    tensordict = tensordict.copy()
    with params.to_module(network) if params is not None else contextlib.nullcontext():
        return network(tensordict)


# ---- value estimators ----
ESTIMATORS = ["TD0", "TD1", "TDLambda", "GAE", "MultiAgentGAE", "SubBatchGAE", "VTrace"]
#: the value network's call paths: vmap, pseudo-vmap, chunks, the shifted call
PATHS = {
    "vmap": {},
    "deactivate_vmap": {"deactivate_vmap": True},
    "chunks": {"value_chunk_size": 3},
    "num_chunks": {"num_chunks": 2, "value_chunk_dim": 1},
    "shifted": {"shifted": True},
    "shifted_chunks": {"shifted": True, "value_chunk_size": 2},
}


class _SubBatchGAE(GAE):
    """Runs ``super().forward`` on sub-batches: calls nested in its own call."""

    def forward(self, tensordict, **kwargs):
        parts = [
            super(_SubBatchGAE, self).forward(part.clone(), **kwargs)
            for part in tensordict.split(1, 0)
        ]
        return tensordict.update(torch.cat(parts, 0))


def _estimator(name="GAE", value_network=None, keep_keys=None, **kwargs):
    """An estimator (a name or a class), on a seeded value network by default."""
    if value_network is None:
        torch.manual_seed(0)
        value_network = _value_network()
    cls = {"TD0": TD0Estimator, "TD1": TD1Estimator, "TDLambda": TDLambdaEstimator}
    cls = {**cls, "GAE": GAE, "SubBatchGAE": _SubBatchGAE, "VTrace": VTrace}
    cls = {**cls, "MultiAgentGAE": MultiAgentGAE}.get(name, name)
    keys = {} if keep_keys is None else {"keep_keys": keep_keys}
    if cls is VTrace:
        torch.manual_seed(10)  # the same actor for every VTrace of a test
        kwargs["actor_network"] = ProbabilisticActor(
            _linear_module("obs", "logits", OBS_DIM, 2),
            in_keys=["logits"],
            distribution_class=torch.distributions.Categorical,
            return_log_prob=True,
        ).to(value_network.device)
        keys["sample_log_prob"] = "sample_log_prob"
    elif issubclass(cls, (TDLambdaEstimator, GAE)):
        kwargs["lmbda"] = 0.95
    estimator = cls(gamma=0.9, value_network=value_network, **kwargs)
    estimator.set_keys(**keys)
    return estimator


def _unsupported_path(name, path, functional):
    """Why the estimator ``name`` has no call path ``path`` (``PATHS``), if so."""
    if functional and path.startswith("shifted"):
        return "shifted=True refuses distinct params and next params"
    if name == "VTrace" and path == "deactivate_vmap":
        return "VTrace has no deactivate_vmap option"
    return None


def _estimator_inputs(name, functional, device="cpu", grad=False):
    """A seeded value network, a rollout (of 3 agents for MultiAgentGAE) with
    observations that require grad if ``grad``, and the call's keyword arguments
    (the network's parameters if ``functional``)."""
    torch.manual_seed(0)
    value_net = _value_network().to(device)
    data = _rollout(device=device)
    data["obs"].requires_grad_(grad)
    if name == "MultiAgentGAE":
        obs = torch.randn(2, BATCH, TIME, 3, OBS_DIM, device=device)
        data["obs"], data["next", "obs"] = obs.requires_grad_(grad).unbind(0)
    params = TensorDict.from_module(value_net) if functional else None
    kwargs = {"params": params, "target_params": params.detach()} if functional else {}
    return value_net, data, kwargs


def _nested_value_net():
    # an extractor, then a layer whose output sits under "critic", then the head
    head = _linear_module(("critic", "hidden"), "state_value", FEAT_DIM, 1)
    trunk = _trunk_head("feat", ("critic", "hidden"), FEAT_DIM)
    return TensorDictSequential(trunk, head)


def _assert_kept(data, stored, value_net, params=None, root=True):
    """Kept ``"hidden"`` entries equal a direct call on the stored steps."""
    expected = _direct(value_net, stored["next"], params)["hidden"]
    torch.testing.assert_close(data["next", "hidden"], expected, equal_nan=True)
    if root:
        expected = _direct(value_net, stored, params)["hidden"]
        torch.testing.assert_close(data["hidden"], expected)


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, []),
        ([], []),
        ("feat", ["feat"]),
        (("critic", "hidden"), [("critic", "hidden")]),
        (["feat", ("critic", "hidden"), "feat"], ["feat", ("critic", "hidden")]),
        (True, (ValueError, "keep_keys must be")),
        (0, (ValueError, "keep_keys must be")),
        ({"feat"}, (ValueError, "keep_keys must be")),
        (["feat", 1], (ValueError, "keep_keys must be")),
        ([""], (ValueError, "keep_keys must be")),
        (("feat", 1), (ValueError, "keep_keys must be")),
        (("critic", ""), (ValueError, "keep_keys must be")),
        ((), (ValueError, "keep_keys must be")),
        ([("next", "feat")], (ValueError, "keep_keys must be")),
        (["obs"], (ValueError, "cannot keep 'obs': .* an input of")),
        (["state_value"], (ValueError, "'state_value': .* its 'value' key")),
        (["advantage"], (ValueError, "'advantage': .* its 'advantage' key")),
        (["reward"], (ValueError, "cannot keep 'reward': .* its 'reward' key")),
        (["features"], (KeyError, r"\['features'\].*'feat'")),
    ],
)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_keep_keys_set_keys(name, value, expected):
    # an accepted setting is stored as a list that round-trips, and None turns
    # it off again; set_keys refuses what is no list of nested keys, and the
    # next call, before the network runs, a key the estimator reads or no
    # network writes
    estimator = _estimator(name, _nested_value_net())
    keys = dataclasses.asdict(estimator.tensor_keys)
    if isinstance(expected, tuple) and expected[1] == "keep_keys must be":
        with pytest.raises(expected[0], match=expected[1]):
            estimator.set_keys(keep_keys=value, value_target="target")
    elif isinstance(expected, tuple):
        estimator.set_keys(keep_keys=value)
        data = _rollout()
        with _linear_calls() as counter, pytest.raises(expected[0], match=expected[1]):
            estimator(data)
        assert counter["calls"] == 0 and "advantage" not in data.keys()
        return
    else:
        estimator.set_keys(keep_keys=value)
        stored = estimator.tensor_keys.keep_keys
        estimator = _estimator(name, _nested_value_net(), stored)
        assert stored == estimator.tensor_keys.keep_keys == expected
        estimator.set_keys(keep_keys=None)
        keys["keep_keys"] = []
    assert dataclasses.asdict(estimator.tensor_keys) == keys


def test_estimator_keep_keys_setting():
    # keep_keys is no constructor argument and takes effect when assigned (a
    # string is one key, as in set_keys); a
    # keyword call stops before the network runs; a locked input gets
    # tensordict's own error; keep_keys is off in a subclass with its own
    # _AcceptedKeys (upstream's pattern)
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_keys'"):
        GAE(gamma=0.9, lmbda=0.9, value_network=_value_network(), keep_keys="h")
    estimator, data = _estimator(), _rollout()
    names = ("obs", "reward", "done", "terminated")
    keywords = {"obs": data["obs"], **{f"next_{k}": data["next", k] for k in names}}
    estimator.tensor_keys.keep_keys = "hidden"
    estimator(data)
    _assert_kept(data, data, estimator.value_network)
    with _linear_calls() as counter:
        with pytest.raises(TypeError, match="called without a tensordict"):
            estimator(**keywords)
    assert counter["calls"] == 0
    with pytest.raises(RuntimeError, match="locked"):
        estimator(_rollout().lock_())
    fields = dataclasses.fields(GAE._AcceptedKeys)
    fields = [(f.name, f.type, f.default) for f in fields if f.name != "keep_keys"]
    keys = dataclasses.make_dataclass("_AcceptedKeys", [*fields, ("extra", str, "x")])
    for own in ({}, {"default_keys": keys}):
        estimator = _estimator(type("MyGAE", (GAE,), {"_AcceptedKeys": keys, **own}))
        estimator.set_keys(advantage="my_advantage")
        data = _rollout()
        reference = _estimator("GAE", estimator.value_network)(data.clone())
        estimator(data)
        torch.testing.assert_close(data["my_advantage"], reference["advantage"])
        with pytest.raises(KeyError, match="keep_keys is not an accepted"):
            estimator.set_keys(keep_keys="hidden")


@pytest.mark.parametrize("device", get_default_devices())
@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("keep_keys,grad", [("hidden", False), (["hidden"], True)])
def test_estimator_keep_keys_matches_direct_call(
    keep_keys, grad, name, path, functional, device
):
    # on every path the estimator keeps what a direct call of the value network
    # writes, with the value's graph, runs the
    # network as often as with keep_keys off and changes nothing else
    if reason := _unsupported_path(name, path, functional):
        pytest.skip(reason)
    if name == "MultiAgentGAE" and path.startswith("shifted"):
        pytest.skip("upstream's shifted call runs on other observations (0.14.1)")
    value_net, data, kwargs = _estimator_inputs(name, functional, device, grad=True)
    reference = data.clone()
    calls, options = [], {"differentiable": grad, **PATHS[path]}
    for keep, td in ((keep_keys, data), (None, reference)):
        estimator = _estimator(name, value_net, keep, **options)
        with _linear_calls() as counter:
            estimator(td, **kwargs)
        calls.append(counter["calls"])
    assert calls[0] == calls[1]
    _assert_same_entries(data.exclude("hidden", ("next", "hidden")), reference)
    _assert_kept(data, reference, value_net, kwargs.get("params"))
    keys = ["hidden", "state_value", ("next", "hidden")]
    assert [data[key].requires_grad for key in keys] == [grad, grad, False]


@pytest.mark.parametrize("chunks", [None, 2])
@pytest.mark.parametrize("terminated", [True, False])
@pytest.mark.parametrize("done_at,budget", [((2,), 2), ((1, 3), 1)])
def test_estimator_keep_keys_shifted_done_steps(done_at, budget, terminated, chunks):
    # the kept next entries are the network's output on the stored next
    # observation, NaN at a terminated step, where it never ran on it;
    # displaced steps (a budget of one slot, two truncations) keep NaN entries
    kwargs = {"shifted_budget": budget, "value_chunk_size": chunks}
    estimator = _estimator(keep_keys="hidden", shifted=True, **kwargs)
    value_net = estimator.value_network
    data = _rollout(done_at=done_at, terminated=terminated)
    stored = data.clone()
    estimator(data)
    expected = _direct(value_net, stored["next"])["hidden"]
    for step in done_at if terminated else ():
        expected[:, step] = float("nan")
    valid = data["shifted_valid"]
    assert valid.all() == (budget == 2 or terminated)  # only truncations shift
    torch.testing.assert_close(
        data["next", "hidden"][valid], expected[valid], equal_nan=True
    )
    evaluated = ~data["hidden"].isnan().all(-1)
    assert evaluated[valid].all()
    expected = _direct(value_net, stored)["hidden"]
    torch.testing.assert_close(data["hidden"][evaluated], expected[evaluated])


def test_estimator_keep_keys_nested_key():
    # a missing parent is created, even beside a root entry named like the
    # key's last part
    estimator = _estimator("GAE", _nested_value_net(), ["feat", ("critic", "hidden")])
    data = _rollout()
    data["hidden"] = torch.zeros(BATCH, TIME)
    stored = data.clone()
    estimator(data)
    expected = _direct(estimator.value_network, stored)["critic", "hidden"]
    torch.testing.assert_close(data["critic", "hidden"], expected)
    assert (data["hidden"] == 0).all()


def test_estimator_keep_keys_recurrent_state():
    # an LSTM value network reads "h" and writes ("next", "h"): its features
    # are kept, and its state cannot be
    torch.manual_seed(0)
    in_keys, out_keys = ["obs", "h", "c"], ["hidden", ("next", "h"), ("next", "c")]
    lstm = LSTMModule(OBS_DIM, FEAT_DIM, in_keys=in_keys, out_keys=out_keys)
    head = _linear_module("hidden", "state_value", FEAT_DIM, 1)
    value_net = TensorDictSequential(lstm, head)
    data = _rollout()
    for key in ("h", "c", ("next", "h"), ("next", "c")):
        data[key] = torch.randn(BATCH, TIME, 1, FEAT_DIM)
    data["is_init"] = data["next", "is_init"] = torch.zeros(BATCH, TIME, 1).bool()
    reference = _estimator("GAE", value_net, deactivate_vmap=True)(data.clone())
    estimator = _estimator("GAE", value_net, "hidden", deactivate_vmap=True)
    estimator(data)
    assert _keys(data) - _keys(reference) == {"hidden", ("next", "hidden")}
    _assert_same_entries(data.exclude("hidden", ("next", "hidden")), reference)
    estimator.set_keys(keep_keys=["h"])
    with pytest.raises(ValueError, match="cannot keep 'h': .* an input of"):
        estimator(data)


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("name", ["TD0", "TD1", "TDLambda", "GAE"])
def test_estimator_keep_keys_nan_next_obs_integer_entries(name, shifted):
    # value_estimate keeps the next entries, and the root ones where it computes
    # the root values (GAE); integers (no NaN for a step not evaluated) are never
    # kept under "next", nor with shifted=True; a NaN next observation gives NaN
    # next entries, as the next value, and finite estimates equal to keep_keys
    # off's, also when a later call under skip_existing recomputes them
    torch.manual_seed(0)
    argmax = TensorDictModule(lambda hidden: hidden.argmax(-1), ["hidden"], ["argmax"])
    value_net = TensorDictSequential(*_value_network(), argmax)
    data, keep = _rollout(done_at=(TIME - 1,)), ["hidden", "argmax"]
    estimate = data.clone()
    _estimator(name, value_net, keep, shifted=shifted).value_estimate(estimate)
    assert ("argmax" in estimate.keys()) == (name == "GAE" and not shifted)
    _assert_kept(estimate, data, value_net, root=name == "GAE")
    data["next", "obs"][:, -1] = float("nan")
    estimators = [_estimator(name, value_net, k, shifted=shifted) for k in (keep, None)]
    tds = [data.clone(), data.clone()]
    for update in (0, 1):
        with torch.no_grad():
            value_net[0].module.weight += update
        with set_skip_existing(True):
            for estimator, td in zip(estimators, tds):
                assert estimator(td) is td  # the input, as upstream returns it
        expected = _direct(value_net, data["next"])
        assert expected["hidden"][:, -1].isnan().all()
        _assert_kept(tds[0], data, value_net)
        torch.testing.assert_close(
            tds[0]["next", "state_value"], expected["state_value"], equal_nan=True
        )
        assert ("argmax" in tds[0].keys()) == (not shifted)
        if not shifted:
            assert (tds[0]["argmax"] == _direct(value_net, data)["argmax"]).all()
        assert ("next", "argmax") not in _keys(tds[0]) | _keys(estimate)
        kept = ["hidden", "argmax", ("next", "hidden")]
        _assert_same_entries(tds[0].exclude(*kept), tds[1])
        assert not tds[1]["advantage"].isnan().any()


requires_compile = pytest.mark.skipif(
    sys.platform == "win32" or sys.version_info >= (3, 14),
    reason="torch.compile is not supported on Windows or Python 3.14+",
)


def _check_compiled(build, data, keep, kept=(), eager_first=False):
    """Under Dynamo (``backend="eager"``), keeping ``keep`` adds no graph, break or
    recompile, and keeps ``kept`` as an eager call does; ``build(keep_keys)``
    returns a new module with that setting."""
    counts = []  # (graphs, graph breaks, recompiles) over two compiled calls
    for setting in (None, keep):
        module = build(setting)
        torch._dynamo.reset()
        counters.clear()
        if eager_first:  # what the module builds lazily is built outside the graph
            module(data())
        compiled = torch.compile(module, backend="eager")
        compiled(data())
        frames = counters["frames"]["total"]
        compiled(data())
        breaks = sum(counters["graph_break"].values())
        frames = counters["frames"]["total"] - frames
        counts.append((counters["stats"]["unique_graphs"], breaks, frames))
    assert all(on <= off for off, on in zip(*counts)), counts
    if not kept:
        return
    eager_data = data()
    compiled_data = eager_data.clone()
    build(keep)(eager_data)
    torch._dynamo.reset()
    torch.compile(build(keep), backend="eager")(compiled_data)
    for key in kept:
        torch.testing.assert_close(compiled_data[key], eager_data[key], msg=str(key))


@requires_compile
def test_compile_keep_keys_gae():
    build = functools.partial(_estimator, "GAE", None)  # build(keep_keys)
    _check_compiled(build, _rollout, "hidden", ["hidden", ("next", "hidden")])


@pytest.mark.slow
@requires_compile
@pytest.mark.parametrize(
    "eager_first", [False, True], ids=["compiled_first", "eager_first"]
)
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("name", ["TD0", "GAE"])
def test_compile_keep_keys_estimator(name, shifted, eager_first):
    # no more graphs, breaks or recompiles, whether the first call is compiled
    build = functools.partial(_estimator, name, None, shifted=shifted)
    _check_compiled(build, _rollout, "hidden", eager_first=eager_first)


def test_keep_keys_in_a_loss_without_the_feature():
    # a loss without keep_keys in its _AcceptedKeys (as upstream documents them)
    # takes no such argument, and set_keys says that it does not support it
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_keys'"):
        ExponentialQuadraticCost(keep_keys=["hidden"])
    with pytest.raises(
        ValueError, match="ExponentialQuadraticCost does not support keep_keys"
    ):
        ExponentialQuadraticCost().set_keys(keep_keys=["hidden"])


def _cat_module(in_keys, out_key, in_features, out_features):
    """A linear layer on the concatenation of ``in_keys``."""

    class Cat(nn.Linear):
        def forward(self, *inputs):
            return super().forward(torch.cat(inputs, -1))

    return TensorDictModule(Cat(in_features, out_features), in_keys, [out_key])


def _gaussian_actor(obs_key="obs", feature_key="actor_feat"):
    trunk = _linear_module(obs_key, feature_key, OBS_DIM, FEAT_DIM)
    head = nn.Sequential(nn.Linear(FEAT_DIM, 2 * ACT_DIM), NormalParamExtractor())
    head = TensorDictModule(head, [feature_key], ["loc", "scale"])
    return ProbabilisticActor(
        TensorDictSequential(trunk, head),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )


def _deterministic_actor():
    trunk = _linear_module("obs", "actor_feat", OBS_DIM, FEAT_DIM)
    head = nn.Sequential(nn.Linear(FEAT_DIM, ACT_DIM), nn.Tanh())
    head = TensorDictModule(head, ["actor_feat"], ["action"])
    return TensorDictSequential(trunk, head)


def _categorical_actor():
    return ProbabilisticActor(
        _trunk_head("actor_feat", "logits", N_ACTIONS),
        in_keys=["logits"],
        distribution_class=torch.distributions.OneHotCategorical,
        return_log_prob=True,
    )


def _qvalue_network():
    """A Q-network with features of the observation, then of the action."""
    return TensorDictSequential(
        _linear_module("obs", "qvalue_feat", OBS_DIM, FEAT_DIM),
        _cat_module(
            ["qvalue_feat", "action"], "qaction_feat", FEAT_DIM + ACT_DIM, FEAT_DIM
        ),
        _linear_module("qaction_feat", "state_action_value", FEAT_DIM, 1),
    )


def _transitions(batch=BATCH, **entries):
    """One step of transitions shaped ``[B]``, with a stored bounded action."""
    obs, action = torch.randn(batch, OBS_DIM), torch.rand(batch, ACT_DIM) * 1.8 - 0.9
    next_ = {"obs": torch.randn(batch, OBS_DIM), "reward": torch.randn(batch, 1)}
    for key in ("done", "terminated"):
        next_[key] = torch.zeros(batch, 1, dtype=torch.bool)
    data = {"obs": obs, "action": action, "next": next_, **entries}
    return TensorDict(data, [batch])


def _one_hot_transitions():
    action = nn.functional.one_hot(torch.randint(N_ACTIONS, (BATCH,)), N_ACTIONS)
    return _transitions(action=action.bool())


def _network_call(loss, name, tensordict, params=None):
    """The loss's network ``name`` on ``tensordict``, with its params or ``params``."""
    params = getattr(loss, f"{name}_params", None) if params is None else params
    with torch.no_grad():
        return _direct(getattr(loss, name), tensordict, params)


def _direct_entry(name, key, next=False, params=None):
    """Network ``name``'s ``key`` on the stored data (its ``"next"`` if ``next``),
    with the params in the loss's attribute ``params`` if given."""
    return lambda loss, td: _network_call(
        loss, name, td["next"] if next else td, params and getattr(loss, params)
    )[key]


def _ensemble_call(loss, name, tensordict, params):
    """One call per ensemble member, stacked after the batch dims."""
    outputs = [_network_call(loss, name, tensordict, member) for member in params]
    return torch.stack(outputs, tensordict.ndim)


@dataclasses.dataclass
class _LossCase:
    """A loss whose networks start with feature extractors, and where outputs land.

    ``expected``: kept destination -> function of (loss, stored data) calling the
    network; ``grads``: kept root entry -> params attribute its graph reaches;
    ``protected``: keys the loss reads; ``sub_losses``: public sub-loss -> what it
    keeps once ``prepare_sub_losses(loss_off, data)`` wrote what it reads;
    ``from_estimator``: destinations its estimator keeps.
    """

    make_loss: object
    make_data: object
    expected: dict
    grads: dict
    protected: list = ()
    sub_losses: dict = dataclasses.field(default_factory=dict)
    prepare_sub_losses: object = None
    from_estimator: list = ()
    device: str = "cpu"

    def __post_init__(self):  # sections edit it: not the list they passed
        self.protected = list(self.protected)

    @property
    def keep_keys(self):
        keys = {k[1:] if k[0] == "next" else k for k in map(_as_tuple, self.expected)}
        return sorted((key[0] if len(key) == 1 else key for key in keys), key=str)

    def build(self, keep_keys=None, seed=0):
        torch.manual_seed(seed)
        loss = self.make_loss().to(self.device)
        loss.set_keys(keep_keys=keep_keys)
        return loss

    def data(self, seed=1):
        torch.manual_seed(seed)
        return self.make_data().to(self.device)


def _run(loss, data, seed=2, method=None):
    torch.manual_seed(seed)
    return loss(data) if method is None else getattr(loss, method)(data)


def _total(out):
    return sum(value.sum() for key, value in out.items() if key.startswith("loss"))


def _grads(loss):
    params = loss.named_parameters()
    return {name: p.grad.clone() for name, p in params if p.grad is not None}


def _epochs(loss, data):
    """Outputs of two calls (PPO epochs) on ``data``, then the grads."""
    outputs = []
    for epoch in range(2):  # the second epoch reads what the first kept
        out = _run(loss, data, seed=epoch)
        _total(out).backward()
        outputs.append(out.detach())
    return [*outputs, TensorDict(_grads(loss))]


def _assert_same_epochs(epochs, reference):
    """Bitwise the same outputs and grads as ``reference`` (from ``_epochs``)."""
    assert not reference[-1].is_empty()
    for out, out_off in zip(epochs, reference):
        _assert_same_entries(out, out_off)


#: every loss case, by name; the contract at the end of this file runs on each
LOSS_CASES = {}


# ---- LossModule: the setting and its calls (through ClipPPOLoss) ----
def _ppo_loss(loss_cls=ClipPPOLoss, keep_keys=("actor_feat", "critic_feat")):
    torch.manual_seed(0)
    loss = loss_cls(_gaussian_actor(), _trunk_head("critic_feat", "state_value"))
    loss.set_keys(keep_keys=list(keep_keys))
    return loss


def _ppo_data(seed=1):
    torch.manual_seed(seed)
    log_prob, loc = torch.randn(BATCH), torch.randn(BATCH, ACT_DIM)
    scale = torch.rand(BATCH, ACT_DIM) + 0.5
    return _transitions(action_log_prob=log_prob, loc=loc, scale=scale)


@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_keep_keys_subclass_forward(halves):
    # a subclass's forward finds the kept entries once super().forward()
    # returns, also when it runs it on halves of its input (each call keeps
    # into its half); its own term reaches the critic's extractor, and the
    # loss's terms are those of the loss with keep_keys off on the (first) part
    class AuxLoss(ClipPPOLoss):
        def forward(self, td):  # the tensordict is found by its name too
            parts = td.split(BATCH // 2, 0) if halves else [td]
            out = [super(AuxLoss, self).forward(part) for part in parts][0]
            td.update(torch.cat(parts, 0))
            out["loss_aux"] = td["critic_feat"].pow(2).mean()
            return out

    loss, data = _ppo_loss(AuxLoss), _ppo_data()
    expected = _network_call(loss, "critic_network", data)["critic_feat"]
    out = loss(td=data)
    torch.testing.assert_close(data["critic_feat"], expected)
    out["loss_aux"].backward()
    extractor = loss.critic_network_params["module", "0", "module", "weight"]
    assert extractor.grad.abs().sum() > 0
    reference = _ppo_loss(keep_keys=())(_ppo_data()[: BATCH // 2 if halves else BATCH])
    _assert_same_entries(out.exclude("loss_aux").detach(), reference.detach())


def test_keep_keys_threads():
    # two threads calling one loss each keep their own input's features
    # (without vmap, which cannot run in two threads at once)
    loss = _ppo_loss()
    loss.make_value_estimator(ValueEstimators.GAE, deactivate_vmap=True)
    barrier, results = threading.Barrier(2), {}

    def run(seed):
        data = _ppo_data(seed)
        expected = _network_call(loss, "critic_network", data)["critic_feat"]
        barrier.wait()
        for call in range(10):
            loss(data)
            results[seed, call] = torch.allclose(data.pop("critic_feat"), expected)

    thread = threading.Thread(target=run, args=(2,))
    thread.start()
    run(1)
    thread.join()
    assert results == {(seed, call): True for seed in (1, 2) for call in range(10)}


def test_keep_keys_user_subclasses_as_upstream():
    # with keep_keys off, subclasses that upstream accepts are created and run
    # as upstream: no-argument methods, a staticmethod forward, slots
    @dataclasses.dataclass(slots=True)
    class _SlotKeys:
        action: str = "action"

    class NoArgument(LossModule):
        _AcceptedKeys = _SlotKeys
        default_keys = _SlotKeys

        def forward(self):
            return TensorDict(loss=torch.zeros(()))

    class Static(LossModule):
        forward = staticmethod(lambda td: td)

    class AuxPPO(ClipPPOLoss):
        def l2_loss(self):
            return sum(p.pow(2).sum() for p in self.parameters())

    assert NoArgument()()["loss"] == 0
    no_argument = NoArgument()
    no_argument.set_keys(action="a2")
    assert no_argument.tensor_keys.action == "a2"
    assert isinstance(Static(), LossModule)
    loss = AuxPPO(_gaussian_actor(), _trunk_head("critic_feat", "state_value"))
    assert loss.l2_loss() > 0


def _td3_loss(loss_cls, *keep_keys):
    """A TD3Loss (subclass) on split networks, keeping ``keep_keys``."""
    torch.manual_seed(0)
    actor, qvalue = _deterministic_actor(), _qvalue_network()
    loss = loss_cls(actor, qvalue, action_spec=None, bounds=(-1.0, 1.0))
    loss.set_keys(keep_keys=list(keep_keys))
    return loss


def test_keep_keys_sub_tensordicts():
    # a nested call on other data (sub-tensordicts, some rows) keeps into that
    # data, never into the outer input
    class SplitTD3(TD3Loss):
        def forward(self, td):
            loss_actor, _ = self.actor_loss(td["online"])
            loss_value, _ = self.value_loss(td["offline"])
            self.actor_loss(td["online"][:2])
            return TensorDict(loss_actor=loss_actor, loss_qvalue=loss_value)

    loss = _td3_loss(SplitTD3, "actor_feat", "qvalue_feat")
    data = TensorDict(online=_transitions(), offline=_transitions(), batch_size=[BATCH])
    stored = data.clone()
    loss(data)
    assert not {"actor_feat", "qvalue_feat"} & set(data.keys())
    expected = _direct(loss.actor_network, stored["online"], loss.actor_network_params)
    torch.testing.assert_close(data["online", "actor_feat"], expected["actor_feat"])
    assert "qvalue_feat" not in data["online"].keys()
    assert {"qvalue_feat", ("next", "actor_feat")} <= _keys(data["offline"])


def test_keep_keys_rows_of_a_lazy_stack():
    # some rows of a lazy stack hold some of its members: other data, kept
    # into those rows, while the loss keeps the whole batch into the stack
    class RowsTD3(TD3Loss):
        def actor_loss(self, td):
            self.rows = td[:2]
            super().actor_loss(self.rows)
            return super().actor_loss(td)

    loss = _td3_loss(RowsTD3, "actor_feat")
    stored = _transitions()
    data = lazy_stack(list(stored.clone().unbind(0)))
    loss(data)
    expected = _direct(loss.actor_network, stored, loss.actor_network_params)
    torch.testing.assert_close(loss.rows["actor_feat"], expected["actor_feat"][:2])
    torch.testing.assert_close(data["actor_feat"], expected["actor_feat"])


def test_keep_keys_reshape_of_all_rows():
    # a reshape holds views, not the very tensors: other data, which keeps what
    # a call on it computes (a loss that reshapes lays it out itself)
    class ReshapeTD3(TD3Loss):
        def actor_loss(self, td):
            self.reshaped = td.unflatten(0, (2, BATCH // 2))
            return super().actor_loss(self.reshaped)

    loss = _td3_loss(ReshapeTD3, "actor_feat")
    data = _transitions()
    stored = data.clone()
    loss(data)
    assert "actor_feat" not in data.keys()
    expected = _direct(loss.actor_network, stored, loss.actor_network_params)
    kept = loss.reshaped["actor_feat"].flatten(0, 1)
    torch.testing.assert_close(kept, expected["actor_feat"])


def test_keep_keys_other_rows_of_the_same_memory():
    # rows of one buffer beside the input's own, as many: other data, although
    # they view the same memory in the same layout
    class SiblingTD3(TD3Loss):
        def actor_loss(self, td):
            super().actor_loss(self.sibling)
            return super().actor_loss(td)

    loss = _td3_loss(SiblingTD3, "actor_feat")
    buffer = _transitions(batch=2 * BATCH)
    stored = buffer.clone()
    data, loss.sibling = buffer[:BATCH], buffer[BATCH:]
    loss(data)
    expected = _direct(loss.actor_network, stored, loss.actor_network_params)
    torch.testing.assert_close(data["actor_feat"], expected["actor_feat"][:BATCH])
    torch.testing.assert_close(
        loss.sibling["actor_feat"], expected["actor_feat"][BATCH:]
    )


def test_keep_keys_transpose_of_a_lazy_stack():
    # a transpose of a lazy stack holds its members in another layout: other
    # data, whose entries land in those members, each in its own rows
    class TransposeTD3(TD3Loss):
        def actor_loss(self, td):
            return super().actor_loss(td.transpose(0, 1))

    loss = _td3_loss(TransposeTD3, "actor_feat")
    stored = _transitions(batch=2 * BATCH).reshape(2, BATCH)
    data = lazy_stack(list(stored.clone().unbind(0)))
    loss(data)
    expected = _direct(loss.actor_network, stored, loss.actor_network_params)
    torch.testing.assert_close(data["actor_feat"], expected["actor_feat"])


def test_keep_keys_modified_copy():
    # a copy whose observation is replaced (an augmentation) is other data: what
    # the actor computes on it stays there, never in the caller's input
    class AugmentedTD3(TD3Loss):
        def actor_loss(self, td):
            augmented = td.clone(False).set("obs", td["obs"] + 1)
            return super().actor_loss(augmented)

    loss = _td3_loss(AugmentedTD3, "actor_feat", "qvalue_feat")
    data = _transitions()
    stored = data.clone()
    loss(data)
    assert "actor_feat" not in data.keys()
    expected = _direct(loss.qvalue_network, stored, loss.qvalue_network_params[0])
    torch.testing.assert_close(data["qvalue_feat"][:, 0], expected["qvalue_feat"])


def test_keep_keys_network_without_out_keys():
    # an actor that is a plain module (upstream's TokenActor pattern) keeps
    # nothing and breaks nothing, and its in_keys cannot be kept
    class PlainActor(nn.Module):
        in_keys = ["obs"]

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(OBS_DIM, 2 * ACT_DIM)

        def get_dist(self, td):
            loc, scale = self.linear(td["obs"]).chunk(2, -1)
            return torch.distributions.Independent(
                torch.distributions.Normal(loc, scale.exp()), 1
            )

    torch.manual_seed(0)
    actor, critic = PlainActor(), _trunk_head("critic_feat", "state_value")
    losses = [ClipPPOLoss(actor, critic, entropy_bonus=False) for _ in range(2)]
    losses[1].set_keys(keep_keys=["critic_feat"])
    outputs = [loss(_ppo_data()) for loss in losses]
    _assert_same_entries(outputs[1], outputs[0])
    losses[1].set_keys(keep_keys=["obs"])
    with pytest.raises(ValueError, match="cannot keep 'obs'"):
        losses[1](_ppo_data())
    actor.out_keys = ["actor_feat"]  # not a TensorDictModuleBase: keeps nothing
    losses[1].set_keys(keep_keys=["actor_feat"])
    with pytest.raises(KeyError, match=r"cannot keep \['actor_feat'\]"):
        losses[1](_ppo_data())


# ---- PPO ----
# what the PPO losses read: the networks' inputs and results, the stored log-prob
_PPO_READS = ("obs", "action", "state_value", "advantage", "action_log_prob")


def _multi_agent_data():
    """A rollout with per-agent observations and actions, shaped ``[B, T]``."""
    data, shape = _rollout(), (BATCH, TIME, 3)
    data["obs"], data["next", "obs"] = torch.randn(2, *shape, OBS_DIM)
    action = torch.rand(*shape, ACT_DIM) * 1.8 - 0.9
    return data.update({"action": action, "action_log_prob": torch.randn(*shape)})


def _actor_critic(shared=False):
    """An actor and a critic; ``shared``: they share a trunk writing ``"hidden"``."""
    if not shared:
        return _gaussian_actor(), _trunk_head("critic_feat", "state_value")
    operator = ActorValueOperator(
        _linear_module("obs", "hidden", OBS_DIM, OBS_DIM),
        _gaussian_actor(obs_key="hidden"),
        _trunk_head("critic_feat", "state_value", obs_key="hidden"),
    )
    return operator.get_policy_operator(), operator.get_value_operator()


def _ppo_case(loss_cls, data=_ppo_data, shared=False, moved=(), reads=_PPO_READS, **kw):
    """A loss on an actor and a critic, whose ``moved`` target parameters differ."""

    def make_loss():
        loss = loss_cls(*_actor_critic(shared), **kw)
        for params in moved:
            getattr(loss, params).apply(lambda param: param.data.add_(1.0))
        return loss

    # a shared trunk's "hidden" is the actor's (the estimator, and the critic with
    # separate_losses=True, run it without graph); the estimator's lands in "next"
    critic_keys = ["critic_feat", "hidden"][: 1 + shared]
    nets = {"actor_feat": "actor", "critic_feat": "critic", "hidden": "actor"}
    nets = {key: nets[key] + "_network" for key in ["actor_feat", *critic_keys]}
    expected = {key: _direct_entry(net, key) for key, net in nets.items()}
    for key in critic_keys:
        expected["next", key] = _direct_entry("critic_network", key, True)
    return _LossCase(
        make_loss,
        data,
        expected,
        grads={key: f"{net}_params" for key, net in nets.items()},
        protected=reads,
        sub_losses={"loss_critic": critic_keys},
        prepare_sub_losses=lambda loss, data: loss.value_estimator(data),
        from_estimator=[("next", key) for key in critic_keys],
    )


# a subclass overriding _log_weight with upstream's signature keeps working
class _LogWeightLoss(ClipPPOLoss):
    def _log_weight(self, tensordict, adv_shape):
        return super()._log_weight(tensordict, adv_shape)


LOSS_CASES.update(
    {
        "ClipPPOLoss": lambda: _ppo_case(ClipPPOLoss),
        "PPOLoss": lambda: _ppo_case(PPOLoss),
        "KLPENPPOLoss": lambda: _ppo_case(
            KLPENPPOLoss, reads=(*_PPO_READS, "loc", "scale")  # the behaviour policy
        ),
        "ClipPPOLoss-shared_trunk": lambda: _ppo_case(ClipPPOLoss, shared=True),
        "ClipPPOLoss-separate_losses": lambda: _ppo_case(
            ClipPPOLoss, shared=True, separate_losses=True
        ),
        # the proximal policy runs on target parameters: the current one's is kept
        "ClipPPOLoss-delay_actor": lambda: _ppo_case(
            ClipPPOLoss, delay_actor=True, moved=["target_actor_network_params"]
        ),
        "ClipPPOLoss-log_weight_subclass": lambda: _ppo_case(_LogWeightLoss),
        "MAPPOLoss": lambda: _ppo_case(MAPPOLoss, _multi_agent_data),
        "IPPOLoss": lambda: _ppo_case(IPPOLoss, _multi_agent_data),
    }
)


def test_ppo_keep_keys_critic_reads_stored_entries():
    # an LSTM critic reads a stored "hidden" that the actor recomputes, and the
    # recurrent state: protected, kept entries leave them as stored (a second epoch does not
    # backpropagate through the first), and the epochs are those of keep_keys off
    keys = ["hidden", "h", "c"], ["critic_feat", ("next", "h"), ("next", "c")]
    lstm = LSTMModule(FEAT_DIM, FEAT_DIM, in_keys=keys[0], out_keys=keys[1])
    head = _linear_module("critic_feat", "state_value", FEAT_DIM, 1)
    loss = ClipPPOLoss(
        _gaussian_actor(feature_key="hidden"), TensorDictSequential(lstm, head)
    )
    loss.make_value_estimator(deactivate_vmap=True)  # vmap cannot run an LSTM
    loss.set_keys(keep_keys=["hidden"])
    with pytest.raises(ValueError, match="'hidden': .* an input of"):
        loss(_ppo_data())
    runs = []
    for keep_keys in (None, ["critic_feat"]):
        loss.set_keys(keep_keys=keep_keys)
        loss.zero_grad()
        data = _ppo_data()
        for key, size in (("hidden", []), ("h", [1]), ("c", [1])):
            data[key], data["next", key] = torch.randn(2, BATCH, *size, FEAT_DIM)
        data["is_init"], data["next", "is_init"] = torch.zeros(2, BATCH, 1).bool()
        stored = data.select("hidden", ("next", "h"), ("next", "c")).clone()
        runs.append(_epochs(loss, data))
        assert (data.select(*stored.keys(True, True)) == stored).all()
    _assert_same_epochs(*runs)
    assert ("next", "next", "h") not in data.keys(True)
    assert data["critic_feat"].requires_grad


@pytest.mark.parametrize("grad, critic_coeff", [(True, 1.0), (False, 1.0), (True, 0)])
def test_ppo_keep_keys_critic_call_wins(grad, critic_coeff):
    # an estimator made later keeps the loss's setting in the loss's calls; at
    # the root the critic loss's call wins over its pass, with or without grad:
    # it keeps the very tensor it computed (no critic loss: the estimator's)
    case = _ppo_case(ClipPPOLoss, critic_coeff=critic_coeff)
    loss, computed = case.build(["critic_feat"]), []
    loss.make_value_estimator(deactivate_vmap=bool(critic_coeff))
    loss.critic_network[0].register_forward_hook(
        lambda module, args, out: computed.append(out["critic_feat"])
    )
    data, stored = case.data(), case.data()
    with torch.set_grad_enabled(grad):
        _run(loss, data)
    if critic_coeff:  # the estimator's root and next passes, then the loss's call
        assert len(computed) == 3
        # with a graph, the very tensor of the critic loss's call; else equal
        torch.testing.assert_close(data["critic_feat"], computed[-1], rtol=0, atol=0)
        assert data["critic_feat"] is computed[-1] or not grad
    assert data["critic_feat"].requires_grad is bool(grad and critic_coeff)
    _check_expected(case, loss, data, stored, ["critic_feat", *case.from_estimator])
    data = case.data()
    loss.value_estimator(data)  # on its own, the estimator has its own setting
    assert not {"critic_feat", ("next", "critic_feat")} & _keys(data)


LOSS_CASES.update({"A2CLoss": lambda: _ppo_case(A2CLoss)})


# ---- SAC ----
def _target_actor_then_value(key):
    """``key`` as the target actor, then the target value network, write it next."""

    def expected(loss, td):
        params = loss.target_actor_network_params, loss.target_value_network_params
        acted = _network_call(loss, "actor_network", td["next"], params[0])
        return _network_call(loss, "value_network", acted, params[1])[key]

    return expected


def _qvalue_entry(key, split=False):
    """``key`` as the Q-nets write it on the stored data (``split``: each its part)."""

    def expected(loss, td):
        params = loss.qvalue_network_params
        if not split:
            return _ensemble_call(loss, "qvalue_network", td, params)[key]
        parts = zip(td.reshape(len(params), -1), params)
        calls = [_network_call(loss, "qvalue_network", *p)[key] for p in parts]
        return torch.cat(calls)

    return expected


_SAC_PROTECTED = ["obs", "action", "state_action_value", "td_error"]


def _offpolicy_case(loss_cls, value_loss=None, qvalue=_qvalue_network, **kwargs):
    """A loss on an actor, ``qvalue()`` Q-nets and, with ``value``, a value net.

    It keeps their features of the stored data and the actor's on "next" (with
    ``next_params``), not the Q-nets' on a sampled action; ``value_loss``: critic's."""
    actor, value = kwargs.pop("actor", _gaussian_actor), kwargs.pop("value", False)
    actor_entry = functools.partial(_direct_entry, "actor_network", "actor_feat")
    next_actor = actor_entry(next=True, params=kwargs.pop("next_params", None))
    if actor is _gaussian_actor:  # the SAC family; IQL passes None
        kwargs.setdefault("target_entropy", -float(ACT_DIM))
    if actor is _categorical_actor:  # it takes one-hot actions
        kwargs["action_space"] = "one-hot"
    kwargs = {key: arg for key, arg in kwargs.items() if arg is not None}
    networks = [qvalue] + [functools.partial(_value_network, "value_feat")] * value
    q_keys = [k for k in ("qvalue_feat", "qaction_feat") if k in qvalue().out_keys]
    expected = {"actor_feat": actor_entry(), **{k: _qvalue_entry(k) for k in q_keys}}
    expected["next", "actor_feat"] = next_actor
    grads = {"actor_feat": "actor_network_params"}
    grads.update(dict.fromkeys(q_keys, "qvalue_network_params"))
    sub_losses = {"actor_loss": ["actor_feat"], value_loss: list(expected)[1:]}
    sub_losses = sub_losses if value_loss else {}
    if value:
        expected["value_feat"] = _direct_entry("value_network", "value_feat")
        grads["value_feat"] = "value_network_params"
        sub_losses["value_loss"] = ["value_feat"]
    return _LossCase(
        lambda: loss_cls(actor(), *[make() for make in networks], **kwargs),
        _one_hot_transitions if actor is _categorical_actor else _transitions,
        expected,
        grads,
        _SAC_PROTECTED + ["state_value"] * value,
        sub_losses,
    )


def _sac_v1_case():
    # SAC v1 trains each Q-net on its own part of the batch; its next-step
    # outputs come from the value estimator's target call
    case = _offpolicy_case(SACLoss, "qvalue_v1_loss", value=True)
    next_keys = [("next", "actor_feat"), ("next", "value_feat")]
    for key in ("qvalue_feat", "qaction_feat"):
        case.expected[key] = _qvalue_entry(key, split=True)
    case.expected.update({key: _target_actor_then_value(key[1]) for key in next_keys})
    case.sub_losses["qvalue_v1_loss"].append(next_keys[1])
    case.from_estimator = next_keys
    return case


def _discrete_sac_case():
    # the Q-nets evaluate every action at once: their call on the next
    # observation involves no sampled action, and is kept
    qvalue = functools.partial(_trunk_head, "qvalue_feat", "action_value", N_ACTIONS)
    kwargs = {"actor": _categorical_actor, "num_actions": N_ACTIONS}
    case = _offpolicy_case(DiscreteSACLoss, "qvalue_loss", qvalue, **kwargs)
    case.expected["next", "qvalue_feat"] = lambda loss, td: _ensemble_call(
        loss, "qvalue_network", td["next"], loss.target_qvalue_network_params
    )["qvalue_feat"]
    case.sub_losses["qvalue_loss"].append(("next", "qvalue_feat"))
    case.protected[2] = "action_value"
    return case


LOSS_CASES.update(
    {
        "SACLoss-v1": _sac_v1_case,
        "SACLoss": lambda: _offpolicy_case(SACLoss, "qvalue_v2_loss"),
        "DiscreteSACLoss": _discrete_sac_case,
    }
)


def _check_kept_entries(case, keep_keys, extra=None, edit=None, seed=2):
    """Checks that ``keep_keys`` keeps ``case.expected`` and ``extra`` as direct calls
    give them, and writes the rest as keep_keys off; ``edit`` edits both losses."""
    expected = {**case.expected, **(extra or {})}
    loss, data, reference = case.build(keep_keys), case.data(), case.data()
    stored = data.clone()
    for module, tensordict in ((case.build(), reference), (loss, data)):
        if edit is not None:
            edit(module)
        out = _run(module, tensordict, seed=seed)
    for key, entry in expected.items():
        torch.testing.assert_close(data.get(key), entry(loss, stored), msg=str(key))
    _assert_same_entries(data.exclude(*expected), reference.exclude(*expected))
    return loss, stored, data.select(*expected), out.detach()


def _check_skip_done_states(case):
    """Checks that ``case`` skipping done states keeps its root entries, no "next"."""
    done = torch.arange(BATCH).unsqueeze(-1) % 2 == 0
    set_done = {("next", "done"): done, ("next", "terminated"): done}
    root = {k: v for k, v in case.expected.items() if _as_tuple(k)[0] != "next"}
    skipping = dataclasses.replace(
        case, make_data=lambda: case.make_data().update(set_done), expected=root
    )

    def skip(loss):
        loss.skip_done_states = True

    _check_kept_entries(skipping, case.keep_keys, edit=skip)


def _check_sampled_actions_skipped(case, actor_keys=("loc", "scale")):
    """Checks that naming the actor's ``actor_keys`` too keeps ``case.expected`` and
    them only, the same whatever actions it samples: none computed on a sampled action."""
    entry = functools.partial(_direct_entry, "actor_network")
    extra = {key: entry(key) for key in actor_keys}
    extra.update({("next", key): entry(key, next=True) for key in actor_keys})
    keep_keys = [*case.keep_keys, *actor_keys]
    runs = [_check_kept_entries(case, keep_keys, extra, seed=seed) for seed in (2, 3)]
    _assert_same_entries(runs[0][2], runs[1][2])
    outs = [run[3] for run in runs]  # the two calls did sample different actions
    assert any(not torch.equal(out, outs[1][key]) for key, out in outs[0].items())


@pytest.mark.parametrize("name", ["SACLoss", "DiscreteSACLoss"])
def test_sac_keep_keys_next_step(name):
    # the next-step calls, run on the steps that are not done only, are not kept;
    # with True, nor what the target Q-nets compute on a next action SAC samples
    _check_skip_done_states(LOSS_CASES[name]())
    if name == "SACLoss":
        _check_sampled_actions_skipped(LOSS_CASES[name]())


# ---- DDPG ----
def _critic_on_action(out_features=1):
    """A critic whose first layer reads the observation and the action."""
    return TensorDictSequential(
        _cat_module(["obs", "action"], "qvalue_feat", OBS_DIM + ACT_DIM, FEAT_DIM),
        _linear_module("qvalue_feat", "state_action_value", FEAT_DIM, out_features),
    )


def _ddpg_case():
    # the value network on the stored action, not on the actor's; under "next",
    # the value estimator's target call of the actor, then of the critic
    nets = {"actor_feat": "actor_network", "qvalue_feat": "value_network"}
    next_keys = [("next", "actor_feat"), ("next", "qvalue_feat")]
    expected = {key: _direct_entry(net, key) for key, net in nets.items()}
    expected.update({key: _target_actor_then_value(key[1]) for key in next_keys})
    return _LossCase(
        lambda: DDPGLoss(_deterministic_actor(), _critic_on_action()),
        _transitions,
        expected,
        {key: f"{net}_params" for key, net in nets.items()},
        _SAC_PROTECTED,
        {"loss_actor": ["actor_feat"], "loss_value": ["qvalue_feat", *next_keys]},
        from_estimator=next_keys,
    )


LOSS_CASES.update({"DDPGLoss": _ddpg_case})


# ---- TD3 ----
def _td3_case(loss_cls, **kwargs):
    # TD3 computes its target itself, its estimator runs no network: the target
    # actor's call lands under "next", without gradients
    value_loss = "qvalue_loss" if issubclass(loss_cls, TD3BCLoss) else "value_loss"
    kwargs.update(actor=_deterministic_actor, bounds=(-1.0, 1.0))
    kwargs["next_params"] = "target_actor_network_params"
    return _offpolicy_case(loss_cls, value_loss, **kwargs)


def _td3_trunk_case(loss_cls, separate):
    # the actor and the Q-nets share the trunk writing "actor_feat": at the root the
    # actor's call (the first with the loss's graph) wins; "next": the target actor's
    def make_loss():
        actor, keys = _deterministic_actor(), ["actor_feat", "action"]
        head = _cat_module(keys, "state_action_value", FEAT_DIM + ACT_DIM, 1)
        qvalue = TensorDictSequential(actor[0], head)
        return loss_cls(actor, qvalue, bounds=(-1.0, 1.0), separate_losses=separate)

    case = _td3_case(loss_cls)
    case.make_loss, case.sub_losses = make_loss, {}
    del case.expected["qvalue_feat"], case.expected["qaction_feat"]
    case.grads = {"actor_feat": "actor_network_params"}
    return case


for cls in (TD3Loss, TD3BCLoss):
    LOSS_CASES[cls.__name__] = functools.partial(_td3_case, cls)
    for suffix, separate in (("", False), ("-separate", True)):
        name = f"{cls.__name__}-shared-trunk{suffix}"
        LOSS_CASES[name] = functools.partial(_td3_trunk_case, cls, separate)


@pytest.mark.parametrize("loss_cls", [TD3Loss, TD3BCLoss])
def test_td3_keep_keys_sub_loss_entry_points(loss_cls):
    # sota-implementations/td3/td3.py calls value_loss, steps, then actor_loss on the
    # batch; a forward may call each on its own part: each call keeps into its input
    # what a direct call gives; losses, grads and parameters are those of keep_keys off
    class SplitLoss(loss_cls):
        def forward(self, tensordict):
            self.parts = tensordict.split(2)
            calls = zip(case.sub_losses, self.parts)
            return TensorDict({m: getattr(self, m)(part)[0] for m, part in calls})

    case, traces, forwards = _td3_case(SplitLoss), [], []
    for keep_keys in (None, case.keep_keys):
        loss, trace = case.build(keep_keys), []
        optim = torch.optim.Adam(loss.parameters(), lr=0.1)  # grads: one network's
        for step in range(2):
            data = case.data(seed=step)
            for method in list(case.sub_losses)[::-1]:
                before = data.clone()
                value, _ = _run(loss, data, seed=step, method=method)
                value.backward()
                trace += [value.detach(), *_grads(loss).values()]
                keys = case.sub_losses[method] if keep_keys else []
                assert _keys(data) - _keys(before) == set(keys)
                _check_expected(case, loss, data, before, keys)
                optim.step()
                optim.zero_grad()
        traces.append(trace + list(loss.state_dict().values()))
        forwards.append((loss, _run(loss, case.data())))
    assert len(traces[0]) == len(traces[1])
    assert all(torch.equal(on, off) for on, off in zip(*traces))
    (loss_off, out_off), (loss, out) = forwards
    _assert_same_entries(out, out_off)
    parts = zip(loss.parts, loss_off.parts, case.data().split(2))
    for (part, part_off, sub), keys in zip(parts, case.sub_losses.values()):
        _check_expected(case, loss, part, sub, keys)
        _assert_same_entries(part.exclude(*keys), part_off.exclude(*keys))


# ---- CrossQ, REDQ, TQC ----
def _crossq_case(qvalue=_qvalue_network):
    case = _offpolicy_case(CrossQLoss, "qvalue_loss", qvalue)
    case.protected.append("_log_prob")
    return case


def _redq_case():
    # REDQ has no public sub-loss; the target Q-nets it draws are not kept either
    case = _offpolicy_case(REDQLoss, num_qvalue_nets=4)
    case.protected.append("state_value")
    return case


def _tqc_qvalue():
    """A critic of 5 quantiles with features of the observation, then of the action."""
    qvalue = _qvalue_network()
    qvalue[-1] = _linear_module("qaction_feat", "state_action_value", FEAT_DIM, 5)
    return qvalue


def _tqc_case(qvalue=_tqc_qvalue):
    # TQCLoss, a SACLoss subclass: its critics on a sampled next action aren't kept
    return _offpolicy_case(TQCLoss, "qvalue_v2_loss", qvalue, num_qvalue_nets=3)


LOSS_CASES.update(CrossQLoss=_crossq_case, REDQLoss=_redq_case, TQCLoss=_tqc_case)


@pytest.mark.parametrize(
    "name", ["CrossQLoss", "REDQLoss", "TQCLoss", "TQC-critic_on_action", "TQC-done"]
)
def test_crossq_redq_tqc_keep_keys_next_step(name):
    # nothing the target Q-nets compute on a sampled next action is
    # kept, by REDQ's sub-sampled ones neither; a critic reading the observation
    # and the action keeps its features on the stored action only. TQC skips the
    # terminated next states as SAC skips the done ones
    critic = functools.partial(_critic_on_action, 5) if "on_action" in name else None
    case = LOSS_CASES[name]() if "Loss" in name else _tqc_case(critic or _tqc_qvalue)
    check = (
        _check_skip_done_states
        if name == "TQC-done"
        else _check_sampled_actions_skipped
    )
    check(case)


def test_crossq_keep_keys_joint_batch_norm():
    """CrossQ normalizes the current and next steps as one batch: the kept root
    features are the first half of that call, not those of a call on the current
    step alone; the second half, on a sampled next action, is not kept."""
    torch.manual_seed(0)
    qvalue = _qvalue_network()
    qvalue[0].module = nn.Sequential(qvalue[0].module, BatchRenorm1d(FEAT_DIM))
    loss, data = _crossq_case(lambda: qvalue).build(["qvalue_feat"]), _transitions()
    stored, params = data.clone(), loss.qvalue_network_params.detach().clone()
    _run(loss, data)
    # the features of the next observation do not depend on the action
    next_ = stored["next"].select("obs").set("action", stored["action"])
    joint = torch.cat([stored.select("obs", "action"), next_], 0)
    expected = _ensemble_call(loss, "qvalue_network", joint, params.clone())
    torch.testing.assert_close(data["qvalue_feat"], expected["qvalue_feat"][:BATCH])
    assert ("next", "qvalue_feat") not in data.keys(True)
    alone = _ensemble_call(loss, "qvalue_network", stored, params.clone())
    assert not torch.allclose(data["qvalue_feat"], alone["qvalue_feat"])


# ---- IQL, CQL ----
def _q_value_actor(feature_key):
    """A Q-value actor whose action values come from features of the observation."""
    return QValueActor(
        _trunk_head(feature_key, "action_value", N_ACTIONS), action_space="one-hot"
    )


def _iql_case(loss_cls=IQLLoss, qvalue=_qvalue_network, **kwargs):
    """The next step kept is the estimator's target value call: no actor runs on it."""
    kwargs.update(value=True, target_entropy=None)
    case = _offpolicy_case(loss_cls, "qvalue_loss", qvalue, **kwargs)
    next_key = ("next", "value_feat")
    del case.expected["next", "actor_feat"]
    case.expected[next_key] = _direct_entry(
        "value_network", "value_feat", True, "target_value_network_params"
    )
    case.sub_losses["qvalue_loss"][-1] = next_key  # in place of the actor's
    case.protected.append("_log_prob")
    case.from_estimator = [next_key]
    return case


def _cql_case(**kwargs):
    # CQL keeps no Q-net call on sampled or random actions (cql_loss, the
    # target) and computes the next value itself
    case = _offpolicy_case(CQLLoss, "q_loss", num_random=3, **kwargs)
    case.sub_losses["actor_bc_loss"] = ["actor_feat"]
    case.protected += ["_log_prob", "pred_q1", "cql_q1_loss"]
    return case


def _discrete_cql_case():
    return _LossCase(
        lambda: DiscreteCQLLoss(_q_value_actor("qvalue_feat"), action_space="one-hot"),
        _one_hot_transitions,
        expected={
            "qvalue_feat": _direct_entry("value_network", "qvalue_feat"),
            # the value estimator's target call, by its own copy of the network
            ("next", "qvalue_feat"): lambda loss, td: _network_call(
                loss.value_estimator, "value_network", td["next"]
            )["qvalue_feat"],
        },
        grads={"qvalue_feat": "value_network_params"},
        protected=["obs", "action", "action_value", "chosen_action_value", "pred_val"]
        + ["td_error"],
        # cql_loss runs no network: it reads the predictions value_loss writes
        sub_losses={"value_loss": ["qvalue_feat", ("next", "qvalue_feat")]},
        from_estimator=[("next", "qvalue_feat")],
    )


LOSS_CASES["IQLLoss"] = _iql_case
LOSS_CASES["DiscreteIQLLoss"] = lambda: _iql_case(
    DiscreteIQLLoss,
    functools.partial(_trunk_head, "qvalue_feat", "state_action_value", N_ACTIONS),
    actor=_categorical_actor,
)
LOSS_CASES["CQLLoss"] = _cql_case
LOSS_CASES["CQLLoss-max_q_backup"] = lambda: _cql_case(max_q_backup=True)
LOSS_CASES["DiscreteCQLLoss"] = _discrete_cql_case


def _shift_targets(loss):
    """Moves the parameters of every target network of ``loss`` off the online ones."""
    for name, params in loss.named_children():
        if name.startswith("target_"):
            params.data.add_(1.0)


@pytest.mark.parametrize("name", ["IQLLoss", "DiscreteIQLLoss", "DiscreteCQLLoss"])
def test_iql_cql_keep_keys_next_step_params(name):
    """Once the target networks (or the value estimator's copy of the network) hold
    params of their own, the Q-nets' own call is kept, though IQL's target Q-nets
    run on the stored action too, and the target's (the copy's) under "next"."""

    def edit(loss):
        if name != "DiscreteCQLLoss":
            return _shift_targets(loss)
        network = loss.value_estimator.value_network
        params = TensorDict.from_module(network).data
        params.apply(lambda p: nn.Parameter(p + 1.0)).to_module(network)

    case = LOSS_CASES[name]()
    *_, out = _check_kept_entries(case, case.keep_keys, edit=edit)
    # the edit does tell the networks apart: the losses change with it
    assert not torch.allclose(_total(out), _total(_run(case.build(), case.data())))


# ---- DQN ----
def _dqn_case(**kwargs):
    """DQNLoss, or DistributionalDQNLoss when ``kwargs`` set its ``gamma``."""
    distributional = "gamma" in kwargs

    def make_loss():
        if distributional:  # with 5 atoms
            network = _trunk_head("dqn_feat", "action_value", 5 * N_ACTIONS)
            atoms = nn.Unflatten(-1, (5, N_ACTIONS))
            network[1].module = nn.Sequential(network[1].module, atoms)
            support = torch.linspace(-1.0, 1.0, 5)
            actor = DistributionalQValueActor(network, support, action_space="one-hot")
            loss = DistributionalDQNLoss(actor, **kwargs)
        else:
            loss = DQNLoss(_q_value_actor("dqn_feat"), action_space="one-hot", **kwargs)
        _shift_targets(loss)  # what is kept on "next" tells the networks apart
        return loss

    target = "target_value_network_params"  # its call on the next observation
    expected = {"dqn_feat": _direct_entry("value_network", "dqn_feat")}
    expected["next", "dqn_feat"] = _direct_entry(
        "value_network", "dqn_feat", True, target
    )
    grads = {"dqn_feat": "value_network_params"}
    protected = ["obs", "action", "action_value", "td_error"]
    protected += ["chosen_action_value"] * (not distributional)
    case = _LossCase(make_loss, _one_hot_transitions, expected, grads, protected)
    # the loss computes the target itself in double and distributional DQN
    if not (distributional or kwargs.get("double_dqn")):
        case.from_estimator = [("next", "dqn_feat")]
    return case


def _qmixer_case():
    """QMixerLoss, keeping features of the agents' observations and of the state."""
    a, feat, mixer_feat = "agents", ("agents", "qmix_feat"), ("mixer", "state_feat")

    def make_loss():
        names = ["action", "action_value", "chosen_action_value"]
        keys = {f"{name}_key": (a, name) for name in names}
        trunk = _trunk_head(feat, (a, "action_value"), N_ACTIONS, (a, "obs"))
        local_value = QValueActor(trunk, action_space="one-hot", **keys)
        mixer = TensorDictSequential(  # the local values' sum, shifted by the state
            _linear_module("state", mixer_feat, OBS_DIM, FEAT_DIM),
            TensorDictModule(
                lambda value, state: value.sum(-2) + state.mean(-1, keepdim=True),
                [(a, "chosen_action_value"), mixer_feat],
                ["chosen_action_value"],
            ),
        )
        loss = QMixerLoss(local_value, mixer, action_space="one-hot")
        _shift_targets(loss)
        return loss

    def make_data():  # transitions with three agents' entries and a global state
        data, shape = _transitions(), (BATCH, 3)
        for td in (data, data["next"]):
            td["agents"] = TensorDict({"obs": torch.randn(*shape, OBS_DIM)}, shape)
            td["state"] = torch.randn(BATCH, OBS_DIM)
        action = torch.randint(N_ACTIONS, shape)
        data["agents", "action"] = nn.functional.one_hot(action, N_ACTIONS).bool()
        return data

    def state_feat(loss, td, target=""):  # the mixer's first layer: no local value
        params = getattr(loss, f"{target}mixer_network_params")["module", "0"]
        return _direct(loss.mixer_network[0], td, params)[mixer_feat]

    target = "target_local_value_network_params"
    expected = {
        # laid out [*B, n_agents, ...], as the local value network writes it
        feat: _direct_entry("local_value_network", feat),
        mixer_feat: state_feat,
        # the value estimator's call of the target networks
        ("next", *feat): _direct_entry("local_value_network", feat, True, target),
        ("next", *mixer_feat): lambda loss, td: state_feat(loss, td["next"], "target_"),
    }
    grads = {feat: "local_value_network_params", mixer_feat: "mixer_network_params"}
    protected = ["state", "chosen_action_value", "td_error"]
    case = _LossCase(make_loss, make_data, expected, grads, protected)
    case.from_estimator = list(expected)[2:]
    return case


LOSS_CASES["DQNLoss"] = _dqn_case
LOSS_CASES["DQNLoss-double_dqn"] = lambda: _dqn_case(double_dqn=True)
LOSS_CASES["DistributionalDQNLoss"] = lambda: _dqn_case(gamma=0.9)
LOSS_CASES["QMixerLoss"] = _qmixer_case


#: (loss, key, role): pytest reads it when it collects, after later sections add theirs
REFUSED_ROLES = [
    ("DQNLoss", "action_value", "its 'action_value' key"),
    # the agents' entries the loss reads, and the local values the mixer reads
    ("QMixerLoss", ("agents", "obs"), "an input of QMixerLoss"),
    ("QMixerLoss", ("agents", "action"), "its 'action' key"),
    ("QMixerLoss", ("agents", "action_value"), "its 'action_value' key"),
    ("QMixerLoss", ("agents", "chosen_action_value"), "its 'local_value' key"),
]


@pytest.mark.parametrize("name,key,role", REFUSED_ROLES)
def test_keep_keys_refused_key_names_its_role(name, key, role):
    """A key the loss or its networks read is refused, naming its role."""
    case = LOSS_CASES[name]()
    loss = case.build([key])
    message = f"{name} cannot keep {key!r}: it is, holds or is inside {role}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _run(loss, case.data())


# ---- Reinforce, GAIL ----
def _reinforce_case(**kw):
    case = _ppo_case(ReinforceLoss, reads=(*_PPO_READS, "value_target"), **kw)
    if kw.get("delay_value"):  # the estimator runs the target critic on the next step
        case.expected["next", "critic_feat"] = _direct_entry(
            "critic_network", "critic_feat", True, "target_critic_network_params"
        )
    return case


def _gail_discriminator():
    """A discriminator with features of the observation and the action."""
    features = ["observation", "action"], "disc_feat", OBS_DIM + ACT_DIM, FEAT_DIM
    head = nn.Sequential(nn.Linear(FEAT_DIM, 1), nn.Sigmoid())
    head = TensorDictModule(head, in_keys=["disc_feat"], out_keys=["d_logits"])
    return TensorDictSequential(_cat_module(*features), head)


def _gail_data(*shape):
    """Expert data, and collector data under their own keys, shaped ``shape``."""
    data = TensorDict(batch_size=shape)
    for prefix, shift in (("", 0), ("collector_", 2)):
        data[prefix + "observation"] = torch.randn(*shape, OBS_DIM) + shift
        data[prefix + "action"] = torch.rand(*shape, ACT_DIM) * 2 - 1
    return data


def _gail_case(*shape, **kw):
    return _LossCase(
        lambda: GAILLoss(_gail_discriminator(), **kw),
        lambda: _gail_data(*(shape or (BATCH,))),
        # the discriminator on the expert data, not on the collector's or interpolations
        expected={"disc_feat": _direct_entry("discriminator_network", "disc_feat")},
        grads={"disc_feat": "discriminator_network_params"},
        protected=[*_gail_data().keys(), "d_logits"],
    )


LOSS_CASES.update(
    {
        "ReinforceLoss": _reinforce_case,
        "ReinforceLoss-delay_value": lambda: _reinforce_case(
            delay_value=True, moved=["target_critic_network_params"]
        ),
        "ReinforceLoss-shared_trunk": lambda: _reinforce_case(
            shared=True, separate_losses=True
        ),
        "GAILLoss": _gail_case,
        "GAILLoss-grad_penalty": lambda: _gail_case(use_grad_penalty=True),
        "GAILLoss-sequence": lambda: _gail_case(BATCH, TIME, use_grad_penalty=True),
    }
)


@pytest.mark.parametrize("keep_keys", [None, ["critic_feat"]])
def test_reinforce_keep_keys_stored_advantage(keep_keys):
    # the actor runs on the input itself and writes there whatever keep_keys
    # says; with the advantage stored the estimator does not run: the critic
    # loss's call is kept, with its graph, and nothing under "next"
    case = _reinforce_case()
    loss, data, keys = case.build(keep_keys), case.data(), ["actor_feat"]
    case.build().value_estimator(data)
    stored = data.clone()
    _run(loss, data)
    _check_expected(case, loss, data, stored, keys + (keep_keys or []))
    assert all(data[key].requires_grad for key in keys + (keep_keys or []))
    assert ("critic_feat" in data.keys()) == bool(keep_keys)
    assert ("next", "critic_feat") not in data.keys(True)


def test_reinforce_gail_keep_keys_constructor_argument():
    # keep_keys is not a constructor argument of these losses: Python says so
    for loss_cls, nets in [(ReinforceLoss, _actor_critic()), (GAILLoss, [])]:
        with pytest.raises(TypeError, match="unexpected keyword argument 'keep_keys'"):
            loss_cls(*nets, keep_keys=["critic_feat"])


# ---- BC, DT, ACT ----
def _bc_case(deterministic=False):
    """BCLoss on a stochastic actor, or on a deterministic one with a pad mask."""

    def make_loss():
        if not deterministic:
            return BCLoss(_gaussian_actor())
        loss = BCLoss(_deterministic_actor(), loss_function="l1")
        loss.set_keys(pad_mask="action_is_pad")
        return loss

    def make_data():
        return _transitions(action_is_pad=torch.eye(BATCH, ACT_DIM, dtype=torch.bool))

    # the stochastic actor's outputs too: all but the action, which the loss reads
    keys = ["actor_feat"] + ["loc", "scale", "action_log_prob"] * (not deterministic)
    expected = {key: _direct_entry("actor_network", key) for key in keys}
    grads = dict.fromkeys(keys, "actor_network_params")
    protected = ["obs", "action"] + ["action_is_pad"] * deterministic
    return _LossCase(make_loss, make_data, expected, grads, protected)


def _dt_case(online=False, batch_dims=2):
    """A DT loss on ``[B, T]`` segments, or ``[B]`` ones holding ``T`` steps."""

    def make_loss():
        head = nn.Sequential(nn.Linear(FEAT_DIM, 2 * ACT_DIM), NormalParamExtractor())
        net = TensorDictSequential(
            _cat_module(["obs", "return_to_go"], "dt_step_feat", OBS_DIM + 1, FEAT_DIM),
            TensorDictModule(lambda x: x.cumsum(-2), ["dt_step_feat"], ["dt_feat"]),
            TensorDictModule(head, ["dt_feat"], ["loc", "scale"]),
        )
        actor = ProbabilisticActor(net, ["loc", "scale"], distribution_class=TanhNormal)
        return OnlineDTLoss(actor, target_entropy=-2.0) if online else DTLoss(actor)

    def make_data():
        data = TensorDict(
            obs=torch.randn(BATCH, TIME, OBS_DIM),
            return_to_go=torch.randn(BATCH, TIME, 1),
            action=torch.rand(BATCH, TIME, ACT_DIM) * 1.8 - 0.9,
            batch_size=[BATCH, TIME][:batch_dims],
        )
        return data.refine_names(..., "time") if batch_dims == 2 else data

    keys = ["dt_step_feat", "dt_feat"]
    expected = {key: _direct_entry("actor_network", key) for key in keys}
    grads = dict.fromkeys(keys, "actor_network_params")
    protected = ["obs", "return_to_go", "action"]
    return _LossCase(make_loss, make_data, expected, grads, protected)


def _act_case(observation="observation"):
    """ACTLoss, reading the observation at ``observation``."""

    def make_loss():
        latent = nn.Sequential(nn.Linear(FEAT_DIM, 2), NormalParamExtractor())
        policy = TensorDictSequential(
            _linear_module("observation", "act_feat", OBS_DIM, FEAT_DIM),
            TensorDictModule(latent, ["act_feat"], ["mu", "log_var"]),
            TensorDictModule(  # a toy decoder: the expert chunk, scaled by the latent
                lambda chunk, mu: chunk * mu.unsqueeze(-1),
                ["action_chunk", "mu"],
                ["action_pred"],
            ),
        )
        loss = ACTLoss(policy)
        loss.set_keys(observation=observation)
        return loss

    def make_data():
        obs, chunk = torch.randn(BATCH, OBS_DIM), torch.randn(BATCH, 3, ACT_DIM)
        return TensorDict({observation: obs, ("vla_action", "chunk"): chunk}, [BATCH])

    def policy_call(loss, td):  # the policy runs on a tensordict of its own keys
        chunk = td["vla_action", "chunk"]
        policy_input = TensorDict(observation=td[observation], action_chunk=chunk)
        return _network_call(loss, "actor_network", policy_input)["act_feat"]

    grads = {"act_feat": "actor_network_params"}
    protected = [observation, ("vla_action", "chunk"), "action_chunk", "mu"]
    protected += ["log_var", "action_pred"]
    return _LossCase(make_loss, make_data, {"act_feat": policy_call}, grads, protected)


# they keep through forward only: no public sub-loss, no value estimator
LOSS_CASES["BCLoss"] = _bc_case
LOSS_CASES["BCLoss-deterministic"] = lambda: _bc_case(deterministic=True)
LOSS_CASES["DTLoss"] = _dt_case
LOSS_CASES["DTLoss-batch_dims1"] = lambda: _dt_case(batch_dims=1)
LOSS_CASES["OnlineDTLoss"] = lambda: _dt_case(online=True)
LOSS_CASES["OnlineDTLoss-batch_dims1"] = lambda: _dt_case(online=True, batch_dims=1)
LOSS_CASES["ACTLoss"] = _act_case
# the policy runs on its own keys: kept entries land in the caller's input
LOSS_CASES["ACTLoss-pixels"] = lambda: _act_case("pixels")

# the expert chunk, under the loss's key and the policy's, is never kept
REFUSED_ROLES += [
    ("ACTLoss", ("vla_action", "chunk"), "its 'action_chunk' key"),
    ("ACTLoss", "action_chunk", "an input of actor_network"),
]


# ---- WorldModel ----
def _world_model_case():
    """WorldModelLoss on a world model with all its heads: what it writes at the
    root (its encoder's features and latent) is kept, its predictions under
    "next" are not."""

    def make_loss():
        encoder = _trunk_head("wm_feat", "latent", FEAT_DIM)
        dynamics = _cat_module(
            ["latent", "action"], ("next", "latent"), FEAT_DIM + ACT_DIM, FEAT_DIM
        )
        reward, done = (
            _linear_module(("next", "latent"), ("next", key), FEAT_DIM, 1)
            for key in ("reward", "done")
        )
        decoder = _linear_module(
            "latent", "reconstructed_observation", FEAT_DIM, OBS_DIM
        )
        world_model = WorldModel(
            encoder, dynamics, reward, done_head=done, decoder=decoder
        )
        loss = WorldModelLoss(world_model, losses=["reward", "done", "reconstruction"])
        loss.set_keys(observation="obs")
        # the checks follow kept graphs to "<network>_params": its own parameters
        loss.world_model_params = TensorDict.from_module(world_model)
        return loss

    keys = ["wm_feat", "latent"]
    expected = {key: _direct_entry("world_model", key) for key in keys}
    grads = dict.fromkeys(keys, "world_model_params")
    # the labels, which the loss renames to their true_* keys, and the reconstruction
    labels = ["reward", "done", "terminated"]
    protected = ["obs", "action", *labels, *(f"true_{key}" for key in labels)]
    protected += ["reconstructed_observation", "predicted_latent", "target_latent"]
    return _LossCase(make_loss, _transitions, expected, grads, protected)


LOSS_CASES["WorldModelLoss"] = _world_model_case
REFUSED_ROLES += [("WorldModelLoss", "true_done", "its 'true_done' key")]


# ---- SFT, Distillation ----
VOCAB = 7


def _llm_actor(feature_key="llm_feat"):
    """Features of the token ids, then the log-probs of the tokens."""
    ids = ("history", "full", "ids")
    head = nn.Sequential(nn.Linear(FEAT_DIM, VOCAB), nn.LogSoftmax(-1))
    return TensorDictSequential(
        TensorDictModule(nn.Embedding(VOCAB, FEAT_DIM), [ids], [feature_key]),
        TensorDictModule(head, [feature_key], ["token_log_probs"]),
        TensorDictModule(
            lambda lp, ids: lp.gather(-1, ids[..., None])[..., 0],
            ["token_log_probs", ids],
            [("log_probs", "full")],
        ),
    )


class _PerSequence(TensorDictModuleBase):
    """Runs ``module`` on each sequence of a lazy stack of ragged ones, as the LLM
    wrappers do; its outputs are the tensordicts that ``module`` writes into."""

    def __init__(self, module):
        super().__init__()
        self.module, self.in_keys = module, module.in_keys
        self.out_keys = list(dict.fromkeys(_as_tuple(k)[0] for k in module.out_keys))

    def forward(self, tensordict):
        for sequence in tensordict.tensordicts:
            self.module(sequence)
        return tensordict


def _llm_data(batch=BATCH, time=TIME):
    """Token ids in place of a chat history (with the masks stored, the losses
    tokenize nothing), masks that leave out a prompt, and teacher log-probs."""
    assistant = torch.arange(time).expand(batch, time) >= 2
    data = {
        ("history", "full", "ids"): torch.randint(VOCAB, (batch, time)),
        ("masks", "all_assistant_mask"): assistant,
        ("masks", "all_attention_mask"): torch.ones_like(assistant),
        ("next", "teacher_log_probs", "full"): -torch.rand(batch, time),
    }
    return TensorDict(data, [batch])


def _llm_case(loss_cls):
    # the actor runs on the history only: all it writes but the log-probs is kept
    keys = ["llm_feat", "token_log_probs"]
    expected = {key: _direct_entry("actor_network", key) for key in keys}
    protected = ["history", ("history", "full"), "log_probs", "masks"]
    protected += [("masks", "all_attention_mask")]
    protected += ["ref_log_probs" if loss_cls is SFTLoss else "teacher_log_probs"]
    return _LossCase(
        lambda: loss_cls(_llm_actor(), tokenizer=object()),
        _llm_data,
        expected,
        grads={},  # no params attribute: test_llm_keep_keys_ragged_sequences
        protected=protected,
    )


LOSS_CASES["SFTLoss"] = lambda: _llm_case(SFTLoss)
LOSS_CASES["DistillationLoss"] = lambda: _llm_case(DistillationLoss)
REFUSED_ROLES += [
    (name, ("masks", "all_assistant_mask"), "an entry it reads")
    for name in ("SFTLoss", "DistillationLoss")
]


@pytest.mark.parametrize("loss_cls", [SFTLoss, DistillationLoss])
def test_llm_keep_keys_ragged_sequences(loss_cls):
    # sequences of different lengths in a lazy stack: a kept tensordict of ragged
    # entries lands in the caller's sequences, with its graph
    torch.manual_seed(0)
    actor = _PerSequence(_llm_actor(("llm", "feat")))
    loss, outputs = loss_cls(actor, tokenizer=object()), []
    for keep_keys in (None, "llm"):
        loss.set_keys(keep_keys=keep_keys)
        torch.manual_seed(1)
        data = lazy_stack([_llm_data(1, time)[0] for time in (3, 5)])
        stored = data.clone()
        outputs.append(loss(data).detach())
    _assert_same_entries(*outputs)
    for sequence, stored_sequence in zip(data.tensordicts, stored.tensordicts):
        expected = actor.module(stored_sequence)["llm", "feat"]
        torch.testing.assert_close(sequence["llm", "feat"], expected)
    weight = actor.module[0].module.weight
    assert torch.autograd.grad(data[1]["llm", "feat"].sum(), weight)[0].abs().sum() > 0


# ---- TD-MPC2 ----
def _tdmpc2_case(bins=5, horizon=3):
    """TdMpc2Loss on [B, H] sequences: its networks run on the stored data at the
    first step (the encoder and the policy prior on the next observations too),
    and on imagined latents at the later steps, which keep NaN."""

    def make_loss():
        # the loss takes the encoder's first output for the latent
        encoder = _trunk_head("obs_feat", "latent", FEAT_DIM)
        encoder = TensorDictSequential(
            encoder, selected_out_keys=["latent", "obs_feat"]
        )
        dynamics = TensorDictSequential(
            _cat_module(["latent", "action"], "dyn_feat", FEAT_DIM + ACT_DIM, FEAT_DIM),
            _linear_module("dyn_feat", ("next", "latent"), FEAT_DIM, FEAT_DIM),
        )
        reward = ["latent", "action"], ("next", "reward_logits"), FEAT_DIM + ACT_DIM
        policy = _TdMpc2PolicyPrior(nn.Linear(FEAT_DIM, 2 * ACT_DIM), -10.0, 2.0)
        policy_keys = ["action", "mean", "log_std", "entropy", "scaled_entropy"]
        q_nets = [nn.Linear(FEAT_DIM + ACT_DIM, bins) for _ in range(2)]
        world_model = WorldModel(encoder, dynamics, _cat_module(*reward, bins))
        loss = TdMpc2Loss(
            world_model,
            TensorDictModule(policy, ["latent"], policy_keys),
            TdMpc2QEnsemble(q_nets, num_bins=bins, vmin=-10.0, vmax=10.0),
            horizon=horizon,
            observation_key="obs",
        )
        # the checks follow kept graphs to "<network>_params": their own parameters
        loss.world_model_params = TensorDict.from_module(world_model)
        loss.q_ensemble_params = TensorDict.from_module(loss.q_ensemble)
        return loss

    def make_data():
        data = torch.stack([_transitions() for _ in range(horizon)], 1)
        return data.refine_names(..., "time")

    def first(key, q=False):  # on the first step's stored data, NaN after it
        def expected(loss, td):
            with torch.no_grad():
                out = loss.world_model(td[:, 0].copy())
                value = (loss.q_ensemble(out) if q else out)[key]
            nan = torch.full_like(value, torch.nan)
            return torch.stack([value, *[nan] * (horizon - 1)], 1)

        return expected

    def next_step(key, policy=False):  # on the next observations
        def expected(loss, td):
            with torch.no_grad():
                out = loss.world_model.encoder(td["next"].copy())
                return (loss.policy_prior(out) if policy else out)[key]

        return expected

    expected = {key: first(key) for key in ["obs_feat", "dyn_feat"]}
    expected["q_logits"] = first("q_logits", q=True)
    expected["next", "obs_feat"] = next_step("obs_feat")
    for key in ["mean", "log_std"]:
        expected["next", key] = next_step(key, policy=True)
    grads = dict.fromkeys(["obs_feat", "dyn_feat"], "world_model_params")
    grads["q_logits"] = "q_ensemble_params"
    protected = ["obs", "action", "reward", "terminated", "latent"]
    sub_losses = {"model_loss": list(expected)}
    return _LossCase(make_loss, make_data, expected, grads, protected, sub_losses)


if MAIN_LOSSES:
    LOSS_CASES["TdMpc2Loss"] = _tdmpc2_case
    # the policy prior and the Q-ensemble read the latent from tensordicts of their own
    REFUSED_ROLES += [("TdMpc2Loss", "latent", "an input of policy_prior")]


@main_only
def test_tdmpc2_keep_keys_noise_conditioned_outputs():
    # the policy prior's entropies depend on its noise: they are not kept even
    # when named, while its mean and log-std on the same call are
    case = _tdmpc2_case()
    loss = case.build([*case.keep_keys, "entropy", "scaled_entropy"])
    data, reference, stored = case.data(), case.data(), case.data()
    _run(loss, data)
    _run(case.build(), reference)
    _check_expected(case, loss, data, stored, case.expected)
    _assert_same_entries(data.exclude(*case.expected), reference)


# ---- RewardModelLoss ----
def _preferences(batch=BATCH):
    """Chosen and rejected responses, each a sub-tensordict of observations."""
    data = {key: {"obs": torch.randn(batch, OBS_DIM)} for key in ("chosen", "rejected")}
    return TensorDict(data, [batch])


@main_only
def test_reward_model_keep_keys():
    # the score network runs on the chosen and on the rejected responses: what it
    # computes on each lands in their sub-tensordict, with its graph, and nothing
    # at the root; two calls on one tensordict give the outputs and grads of off
    runs = []
    for keep_keys in (None, "rm_feat"):
        torch.manual_seed(0)
        loss = RewardModelLoss(_trunk_head("rm_feat", "score"), center_coeff=0.1)
        loss.set_keys(keep_keys=keep_keys)
        torch.manual_seed(1)
        data = _preferences()
        stored = data.clone()
        runs.append(_epochs(loss, data))
    _assert_same_epochs(runs[1], runs[0])
    for key in ("chosen", "rejected"):
        expected = _direct(loss.score_network, stored[key])["rm_feat"]
        torch.testing.assert_close(data[key, "rm_feat"], expected)
        assert data[key, "rm_feat"].requires_grad
    assert set(data.keys()) == {"chosen", "rejected"}
    roles = {"obs": "an input of score_network", "score": "its 'score' key"}
    for key, role in {**roles, "chosen": "its 'chosen' key"}.items():
        loss.set_keys(keep_keys=key)
        with pytest.raises(ValueError, match=f"cannot keep '{key}': .*{role}"):
            loss(data)


# ---- FQL, TransitiveQ ----
def _fql_case():
    # each policy starts with an observation encoder: its features are kept (the
    # one-step policy's on "next" too), the policy's noise-conditioned output is not
    def make_loss():
        flow_head = nn.Linear(FEAT_DIM + ACT_DIM + 1, ACT_DIM)
        flow = FlowMatchingPolicy(flow_head, ACT_DIM, in_keys=["flow_feat"])
        actor_head = nn.Linear(FEAT_DIM + ACT_DIM, ACT_DIM)
        actor = OneStepPolicy(actor_head, ACT_DIM, in_keys=["actor_feat"])
        flow, actor = (
            TensorDictSequential(
                _linear_module("obs", policy.in_keys[0], OBS_DIM, FEAT_DIM), policy
            )
            for policy in (flow, actor)
        )
        return FQLLoss(flow, actor, _qvalue_network())

    q_keys = ["qvalue_feat", "qaction_feat"]
    expected = {
        "flow_feat": _direct_entry("flow_policy", "flow_feat"),
        "actor_feat": _direct_entry("actor_network", "actor_feat"),
        ("next", "actor_feat"): _direct_entry("actor_network", "actor_feat", True),
        **{key: _qvalue_entry(key) for key in q_keys},
    }
    grads = {"flow_feat": "flow_policy_params", "actor_feat": "actor_network_params"}
    grads.update(dict.fromkeys(q_keys, "qvalue_network_params"))
    sub_losses = {"flow_loss": ["flow_feat"], "actor_loss": ["flow_feat", "actor_feat"]}
    sub_losses["qvalue_loss"] = list(expected)[2:]
    protected = [*_SAC_PROTECTED, ("fql", "noise"), ("fql", "time")]
    return _LossCase(make_loss, _transitions, expected, grads, protected, sub_losses)


def _tq_entry(name, key, goal_record, goal="observation", flat=False):
    """``key`` as network ``name`` writes it on the anchors ``[..., 0]`` with the
    ``goal`` of record ``goal_record``, at the anchors of the records, NaN elsewhere."""

    def expected(loss, td):
        records = td.reshape(-1, 4) if flat else td
        anchors = records[..., 0].select("observation", "action")
        anchors["goal"] = records[..., goal_record][goal]
        if name == "actor_network":
            value = _network_call(loss, name, anchors)[key]
        else:
            params = getattr(loss, f"{name}_params")
            value = _ensemble_call(loss, name, anchors, params)[key]
        nan = torch.full_like(value, float("nan"))
        value = torch.stack([value, nan, nan, nan], 1)
        return value.flatten(0, 1) if flat else value

    return expected


def _tq_case(oracle=False, flat=False, **kwargs):
    # the actor and the critics run on the anchor records, with another record's
    # goal; flat: SubgoalTriplet's [4 * B] records, which the loss unflattens
    goal = "policy_goal" if oracle else "observation"

    def critic(feature_key):
        features = ["observation", "goal"], feature_key, 2 * OBS_DIM, FEAT_DIM
        return TensorDictSequential(
            _cat_module(*features),
            _cat_module(
                [feature_key, "action"], "state_action_value", FEAT_DIM + ACT_DIM, 1
            ),
        )

    def make_loss():
        head = nn.Sequential(nn.Linear(FEAT_DIM, 2 * ACT_DIM), NormalParamExtractor())
        actor = TensorDictSequential(
            _cat_module(["observation", "goal"], "actor_feat", 2 * OBS_DIM, FEAT_DIM),
            TensorDictModule(head, ["actor_feat"], ["loc", "scale"]),
        )
        actor = ProbabilisticActor(
            actor, ["loc", "scale"], distribution_class=IndependentNormal
        )
        oracle_net = critic("oracle_feat") if oracle else None
        loss = TransitiveQLoss(
            actor, critic("qvalue_feat"), oracle_qvalue_network=oracle_net, **kwargs
        )
        loss.set_keys(policy_goal=goal)
        return loss

    def make_data():
        data = TensorDict(
            observation=torch.randn(BATCH, 4, OBS_DIM),
            action=torch.rand(BATCH, 4, ACT_DIM) * 1.8 - 0.9,
            policy_goal=torch.randn(BATCH, 4, OBS_DIM),
            step_offset=torch.tensor([0, 1, 5, 3]).repeat(BATCH, 1),
            batch_size=[BATCH, 4],
        )
        return data.reshape(-1) if flat else data

    expected = {
        "actor_feat": _tq_entry("actor_network", "actor_feat", 3, goal, flat),
        "qvalue_feat": _tq_entry("qvalue_network", "qvalue_feat", 2, flat=flat),
    }
    grads = {"actor_feat": "actor_network_params"}
    grads["qvalue_feat"] = "qvalue_network_params"
    if oracle:
        net = "oracle_qvalue_network"
        expected["oracle_feat"] = _tq_entry(net, "oracle_feat", 2, goal, flat)
        grads["oracle_feat"] = f"{net}_params"
    sub_losses = {"qvalue_loss": list(expected)[1:], "actor_loss": ["actor_feat"]}
    protected = ["observation", "action", "goal", "step_offset", "validity_mask"]
    protected.append("state_action_value")
    return _LossCase(
        make_loss, make_data, expected, grads, protected, {} if flat else sub_losses
    )


if MAIN_LOSSES:
    LOSS_CASES["FQLLoss"] = _fql_case
    LOSS_CASES["TransitiveQLoss"] = _tq_case
    LOSS_CASES["TransitiveQLoss-oracle"] = lambda: _tq_case(oracle=True)
    LOSS_CASES["TransitiveQLoss-flat"] = lambda: _tq_case(flat=True)


@main_only
@pytest.mark.parametrize("method", [None, "actor_loss"])
def test_fql_keep_keys_noise_conditioned_outputs(method):
    # the policies' noise-conditioned output is not kept even when named, nor are
    # the critics' features on the one-step policy's action (actor_loss's only
    # critic call); the kept features are direct calls', whatever noise was drawn
    case, losses = _fql_case(), []
    keys = list(case.expected) if method is None else case.sub_losses[method]
    for seed in (2, 3):
        loss = case.build([*case.keep_keys, ("fql", "output")])
        data, reference = case.data(), case.data()
        stored = data.clone()
        out = _run(loss, data, seed, method)
        _run(case.build(), reference, seed, method)
        _check_expected(case, loss, data, stored, keys)
        _assert_same_entries(data.exclude(*keys), reference)
        losses.append(out[0] if method else out["loss_actor"])
    assert not torch.equal(*losses)  # the calls drew different noise


@main_only
@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("actor_action", ["mode", "rsample"])
def test_transitive_q_keep_keys_actor_actions(actor_action, oracle):
    # actor_loss scores the actor's action with the critics, or the oracle: what
    # they compute there is not kept; what the actor computes is
    case = _tq_case(oracle, actor_action=actor_action)
    goal = "policy_goal" if oracle else "observation"
    case.expected["loc"] = _tq_entry("actor_network", "loc", 3, goal)
    loss, data, reference = case.build(case.keep_keys), case.data(), case.data()
    stored = data.clone()
    _run(loss, data, method="actor_loss")
    _run(case.build(), reference, method="actor_loss")
    _check_expected(case, loss, data, stored, ["actor_feat", "loc"])
    _assert_same_entries(data.exclude("actor_feat", "loc"), reference)


# ---- the contract of every loss that keeps ----
@pytest.fixture(
    params=[(name, device) for name in LOSS_CASES for device in get_default_devices()],
    ids=lambda param: f"{param[0]}-{param[1]}",
)
def case(request):
    return dataclasses.replace(LOSS_CASES[request.param[0]](), device=request.param[1])


def _check_expected(case, loss, data, stored, keys):
    for key in keys:
        value, expected = data.get(key), case.expected[key](loss, stored)
        torch.testing.assert_close(value, expected, equal_nan=True, msg=str(key))


def test_keep_keys_calls(case):
    # over epochs on one tensordict, the outputs, grads and other entries are
    # bitwise those of keep_keys off; kept entries equal direct calls of the
    # networks, and at the root carry the loss's graph to the extractors
    # (next-step ones carry none)
    reference = case.data()
    epochs_off = _epochs(case.build(), reference)
    loss = case.build()
    loss.tensor_keys.keep_keys = case.keep_keys
    grad = functools.partial(torch.autograd.grad, retain_graph=True, allow_unused=True)
    data, stored, fresh = case.data(), case.data(), case.data()
    _assert_same_epochs(_epochs(loss, data), epochs_off)
    _run(loss, fresh)  # a call whose graph the checks below follow
    for key, params_name in case.grads.items():
        params = getattr(loss, params_name).values(True, True)
        params = [param for param in params if param.requires_grad]
        grads = grad(fresh.get(key).pow(2).sum(), params)
        assert any(g is not None and g.abs().sum() > 0 for g in grads), key
    for key in case.expected:
        assert _as_tuple(key)[0] != "next" or not fresh.get(key).requires_grad, key
    _check_expected(case, loss, data, stored, case.expected)
    kept = list(case.expected)
    _assert_same_entries(data.exclude(*kept), reference.exclude(*kept))
    # each public sub-loss keeps into the tensordict it is given, and
    # otherwise writes what it writes with keep_keys off
    for method, keys in case.sub_losses.items():
        written = []
        for keep_keys in (None, case.keep_keys):
            loss, data = case.build(keep_keys), case.data()
            if case.prepare_sub_losses is not None:
                case.prepare_sub_losses(case.build(), data)
            stored = data.clone()
            _run(loss, data, method=method)
            written.append(data)
        _check_expected(case, loss, written[1], stored, keys)
        _assert_same_entries(written[1].exclude(*keys), written[0].exclude(*keys))


@pytest.mark.parametrize("name", sorted({"ClipPPOLoss", "DQNLoss"} & set(LOSS_CASES)))
def test_keep_keys_epochs_under_skip_existing(name):
    # kept entries are not inputs of the next epoch under skip_existing either
    # (without a stored loc and scale, which would keep the actor from running)
    case = LOSS_CASES[name]()
    with set_skip_existing(True):
        runs = [
            _epochs(case.build(keep_keys), case.data().exclude("loc", "scale"))
            for keep_keys in (None, case.keep_keys)
        ]
    _assert_same_epochs(runs[1], runs[0])


def test_keep_keys_setting(case):
    # set_keys only stores the setting, which round-trips and survives an
    # unrelated set_keys, and builds no value estimator; the next call refuses
    # keys the loss reads and unknown keys before any network runs, and a call
    # with keywords has nowhere to write
    loss = case.build()
    state_keys = set(loss.state_dict())
    loss.set_keys(keep_keys=case.keep_keys)
    assert set(loss.state_dict()) == state_keys  # no value estimator built
    other = next(
        f.name for f in dataclasses.fields(loss.tensor_keys) if f.name != "keep_keys"
    )
    loss.set_keys(**{other: getattr(loss.tensor_keys, other)})
    rebuilt = case.build(loss.tensor_keys.keep_keys)
    assert loss.tensor_keys.keep_keys == rebuilt.tensor_keys.keep_keys == case.keep_keys
    data = case.data()
    present = [key for key in getattr(loss, "in_keys", ()) if key in data.keys(True)]
    kwargs = {"_".join(_as_tuple(unravel_key(key))): data.get(key) for key in present}
    with _linear_calls() as counter:
        with pytest.raises(TypeError, match="called without a tensordict"):
            loss(**kwargs)
        for key in case.protected:
            loss.set_keys(keep_keys=[*case.keep_keys, key])
            with pytest.raises(ValueError, match=re.escape(f"cannot keep {key!r}: ")):
                _run(loss, data)
        loss.set_keys(keep_keys=["no_such_entry"])
        with pytest.raises(KeyError, match=r"\['no_such_entry'\].*They write"):
            _run(loss, data)
    assert counter["calls"] == 0
    assert not set(case.expected) & _keys(data)


@requires_compile
def test_compile_keep_keys_clip_ppo():
    case = LOSS_CASES["ClipPPOLoss"]()
    _check_compiled(case.build, case.data, case.keep_keys, list(case.expected))


@pytest.mark.slow
@requires_compile
@pytest.mark.parametrize("first", ["compiled_first", "eager_first"])
@pytest.mark.parametrize("name", [name for name in LOSS_CASES if "-" not in name])
def test_compile_keep_keys_loss(name, first):
    # one case per loss class: its variants ("DQNLoss-double_dqn") compile alike
    case = LOSS_CASES[name]()
    _check_compiled(
        case.build, case.data, case.keep_keys, eager_first=first == "eager_first"
    )
