# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""``keep_keys``: the network outputs that value estimators and losses keep.

Every network starts with a feature extractor whose output the tests keep, and
every kept entry is checked against a direct call of the network on the stored
data, or against the same call with ``keep_keys`` off.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import re
import sys
import threading

import pytest
import torch
from tensordict import TensorDict, unravel_key
from tensordict.nn import (
    NormalParamExtractor,
    set_skip_existing,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn
from torch._dynamo.utils import counters
from torch.distributions import Categorical, Independent, Normal, OneHotCategorical
from torchrl import objectives
from torchrl.modules import (
    ActorValueOperator,
    DistributionalQValueActor,
    ProbabilisticActor,
    QValueActor,
    set_recurrent_mode,
    TanhNormal,
)
from torchrl.objectives.value import (
    GAE,
    MultiAgentGAE,
    TD0Estimator,
    TD1Estimator,
    TDLambdaEstimator,
    VTrace,
)
from torchrl.testing import get_default_devices

OBS_DIM, ACT_DIM, FEAT_DIM, N_ACTIONS = 3, 2, 4, 3
BATCH, TIME = 4, 6


class _CatLinear(nn.Linear):
    def forward(self, *inputs):  # a linear layer on its inputs, concatenated
        return super().forward(torch.cat(inputs, -1))


def _linear(in_keys, out_key, in_features, out_features=FEAT_DIM):
    in_keys = [in_keys] if isinstance(in_keys, (str, tuple)) else in_keys
    layer = (_CatLinear if len(in_keys) > 1 else nn.Linear)(in_features, out_features)
    return TensorDictModule(layer, in_keys, [out_key])


def _trunk_head(feature_key, out_key, out_features=1, obs_key="obs"):
    head = _linear(feature_key, out_key, FEAT_DIM, out_features)
    return TensorDictSequential(_linear(obs_key, feature_key, OBS_DIM), head)


def _rollout(device="cpu", done_at=(), terminated=True):
    """Rollout-like data shaped ``[B, T]``, with the time dim named ``"time"``."""
    obs, done = torch.randn(BATCH, TIME + 1, OBS_DIM), torch.zeros(BATCH, TIME, 1)
    done[:, list(done_at)] = 1
    next_ = {"obs": obs[:, 1:].clone(), "reward": torch.randn(BATCH, TIME, 1)}
    next_.update(done=done.bool(), terminated=done.bool() & terminated)
    data = {"obs": obs[:, :-1].clone(), "action": torch.randint(2, (BATCH, TIME))}
    data.update(sample_log_prob=torch.randn(BATCH, TIME), next=next_)
    return TensorDict(data, [BATCH, TIME]).refine_names(..., "time").to(device)


def _transitions(**entries):
    """One step of transitions shaped ``[B]``, with a stored bounded action."""
    obs, action = torch.randn(BATCH, OBS_DIM), torch.rand(BATCH, ACT_DIM) * 1.8 - 0.9
    next_ = {"obs": torch.randn(BATCH, OBS_DIM), "reward": torch.randn(BATCH, 1)}
    next_["done"] = next_["terminated"] = torch.zeros(BATCH, 1, dtype=torch.bool)
    return TensorDict({"obs": obs, "action": action, "next": next_, **entries}, [BATCH])


def _keys(tensordict):
    return set(tensordict.keys(True, True))


def _as_tuple(key):
    return (key,) if isinstance(key, str) else key


def _assert_same_entries(tensordict, reference):  # bitwise
    assert _keys(tensordict) == _keys(reference)
    for key in _keys(reference):
        torch.testing.assert_close(
            tensordict.get(key), reference.get(key), rtol=0, atol=0, equal_nan=True
        )


@contextlib.contextmanager
def _linear_calls():  # counts the calls of every nn.Linear
    counter = {"calls": 0}

    def hook(module, args):
        counter["calls"] += isinstance(module, nn.Linear)

    with torch.nn.modules.module.register_module_forward_pre_hook(hook):
        yield counter


def _direct(network, tensordict, params=None):
    """What ``network`` writes when called on ``tensordict`` itself."""
    context = contextlib.nullcontext()
    if params is not None:  # a copy, into which to_module swaps the network's own
        context = params.detach().clone().to_module(network)
    with torch.no_grad(), context:
        return network(tensordict.copy())


# ---- value estimators ----
ESTIMATORS = {"TD0": TD0Estimator, "TD1": TD1Estimator, "TDLambda": TDLambdaEstimator}
ESTIMATORS.update(GAE=GAE, MultiAgentGAE=MultiAgentGAE, VTrace=VTrace)
#: the value network's call paths: vmap, pseudo-vmap, chunks, the shifted call
PATHS = {
    "vmap": {},
    "deactivate_vmap": {"deactivate_vmap": True},
    "chunks": {"value_chunk_size": 3},
    "num_chunks": {"num_chunks": 2, "value_chunk_dim": 1},
    "shifted": {"shifted": True},
    "shifted_chunks": {"shifted": True, "value_chunk_size": 2},
}


def _estimator(name="GAE", value_network=None, keep_keys=None, **kwargs):
    """An estimator (a name or a class), on a seeded value network by default."""
    if value_network is None:
        torch.manual_seed(0)
        value_network = _trunk_head("hidden", "state_value")
    cls = ESTIMATORS.get(name, name)
    keys = {} if keep_keys is None else {"keep_keys": keep_keys}
    if cls is VTrace:
        torch.manual_seed(10)  # the same actor for every VTrace of a test
        logits = _linear("obs", "logits", OBS_DIM, 2)
        actor = ProbabilisticActor(
            logits, ["logits"], distribution_class=Categorical, return_log_prob=True
        )
        kwargs["actor_network"] = actor.to(value_network.device)
        keys["sample_log_prob"] = "sample_log_prob"
    elif issubclass(cls, (TDLambdaEstimator, GAE)):
        kwargs["lmbda"] = 0.95
    estimator = cls(gamma=0.9, value_network=value_network, **kwargs)
    estimator.set_keys(**keys)
    return estimator


def _nested_value_net():
    # an extractor, then a layer whose output sits under "critic", then the head
    trunk = _trunk_head("feat", ("critic", "hidden"), FEAT_DIM)
    head = _linear(("critic", "hidden"), "state_value", FEAT_DIM, 1)
    return TensorDictSequential(trunk, head)


def _assert_kept(data, stored, value_net, params=None, root=True, key="hidden"):
    """Kept ``key`` entries equal a direct call on the stored steps."""
    expected = _direct(value_net, stored["next"], params)[key]
    torch.testing.assert_close(data["next", key], expected, equal_nan=True)
    if root:
        torch.testing.assert_close(data[key], _direct(value_net, stored, params)[key])


# ---- losses: networks, data and the checks the tests share ----
def _gaussian_actor(obs_key="obs", feature_key="actor_feat"):
    head = nn.Sequential(nn.Linear(FEAT_DIM, 2 * ACT_DIM), NormalParamExtractor())
    head = TensorDictModule(head, [feature_key], ["loc", "scale"])
    net = TensorDictSequential(_linear(obs_key, feature_key, OBS_DIM), head)
    return ProbabilisticActor(
        net, ["loc", "scale"], distribution_class=TanhNormal, return_log_prob=True
    )


def _deterministic_actor():
    head = nn.Sequential(nn.Linear(FEAT_DIM, ACT_DIM), nn.Tanh())
    head = TensorDictModule(head, ["actor_feat"], ["action"])
    return TensorDictSequential(_linear("obs", "actor_feat", OBS_DIM), head)


def _categorical_actor():
    net = _trunk_head("actor_feat", "logits", N_ACTIONS)
    return ProbabilisticActor(
        net, ["logits"], distribution_class=OneHotCategorical, return_log_prob=True
    )


def _qvalue_network(out_features=1):  # features of the observation, then action
    return TensorDictSequential(
        _linear("obs", "qvalue_feat", OBS_DIM),
        _linear(["qvalue_feat", "action"], "qaction_feat", FEAT_DIM + ACT_DIM),
        _linear("qaction_feat", "state_action_value", FEAT_DIM, out_features),
    )


def _q_value_actor(feature_key):
    network = _trunk_head(feature_key, "action_value", N_ACTIONS)
    return QValueActor(network, action_space="one-hot")


def _one_hot_transitions():
    action = nn.functional.one_hot(torch.randint(N_ACTIONS, (BATCH,)), N_ACTIONS)
    return _transitions(action=action.bool())


def _ppo_data():
    log_prob, loc = torch.randn(BATCH), torch.randn(BATCH, ACT_DIM)
    return _transitions(action_log_prob=log_prob, loc=loc, scale=loc.exp())


def _expected(loss, stored, key, spec):
    """What the kept ``key`` holds: ``spec`` is a function of (loss, stored data), or
    networks of the loss (a dotted name or (name, params name)) called in turn on
    the stored data, or its ``"next"`` for a next-step key, as losses run them."""
    if callable(spec):
        return spec(loss, stored)
    key, td = _as_tuple(key), stored
    if key[0] == "next":
        key, td = key[1:], stored["next"]
    for net in spec if isinstance(spec, list) else [spec]:
        name, params = (net, None) if isinstance(net, str) else net
        network = functools.reduce(getattr, name.split("."), loss)
        with set_recurrent_mode(True):
            td = _direct(network, td, getattr(loss, params or f"{name}_params", None))
    return td[key]


def _qvalue_entry(key, params="qvalue_network_params", next=False, split=False):
    """``key`` as the ensemble of Q-nets (``params``) writes it on the stored data,
    stacked after the batch dims (``split``: each member on its part)."""

    def expected(loss, td):
        td, members = td["next"] if next else td, getattr(loss, params)
        call = functools.partial(_direct, loss.qvalue_network)
        if split:
            parts = zip(td.reshape(len(members), -1), members)
            return torch.cat([call(*part)[key] for part in parts])
        return torch.stack([call(td, member)[key] for member in members], td.ndim)

    return expected


def _shift_targets(loss):  # target networks whose params differ from the online
    for name, params in loss.named_children():
        if name.startswith("target_"):
            params.data.add_(1.0)


@dataclasses.dataclass
class _LossCase:
    """A loss and its data. ``expected``: kept destination -> what it holds (see
    ``_expected``); ``sub_losses``: public sub-loss -> what it keeps, once
    ``prepare(loss, data)`` wrote what it reads; ``edit(loss)`` edits new losses;
    ``roles``: read key -> the role the error names."""

    make_loss: object
    make_data: object
    expected: dict
    sub_losses: dict = dataclasses.field(default_factory=dict)
    prepare: object = None
    edit: object = None
    roles: dict = dataclasses.field(default_factory=dict)
    device: str = "cpu"

    @property
    def keep_keys(self):
        keys = {k[1:] if k[0] == "next" else k for k in map(_as_tuple, self.expected)}
        return sorted((key[0] if len(key) == 1 else key for key in keys), key=str)

    def build(self, keep_keys=None, seed=0):
        torch.manual_seed(seed)
        loss = self.make_loss().to(self.device)
        if self.edit is not None:
            self.edit(loss)
        loss.set_keys(keep_keys=keep_keys)
        return loss

    def data(self, seed=1):
        torch.manual_seed(seed)
        return self.make_data().to(self.device)

    def check(self, loss, data, stored, keys):
        for key in keys:
            expected = _expected(loss, stored, key, self.expected[key])
            torch.testing.assert_close(data.get(key), expected, msg=str(key))


def _run(loss, data, seed=2, method=None):
    torch.manual_seed(seed)
    return loss(data) if method is None else getattr(loss, method)(data)


def _train(loss, data, methods=(None,), check=None):
    """Calls ``methods`` (None: forward) in turn for two epochs, stepping after
    each; returns outputs, grads, parameters and network calls."""
    trace, calls = [], 0
    optim = torch.optim.Adam(loss.parameters(), lr=0.1)
    for epoch in range(2):  # the second epoch reads what the first kept
        for method in methods:
            with _linear_calls() as counter:
                out = _run(loss, data, seed=epoch, method=method)
            calls += counter["calls"]
            out = out[0] if isinstance(out, tuple) else out  # sub-losses
            out = TensorDict(loss=out) if isinstance(out, torch.Tensor) else out
            if check is not None and epoch == 0:
                check(method)
            sum(v.sum() for k, v in out.items() if k.startswith("loss")).backward()
            named = loss.named_parameters()
            grads = {k: p.grad.clone() for k, p in named if p.grad is not None}
            trace += [out.detach(), TensorDict(grads)]
            optim.step()
            optim.zero_grad()
    assert not trace[1].is_empty()
    return trace + [TensorDict({**loss.state_dict(), "calls": torch.tensor(calls)})]


def _assert_same_traces(trace, reference):
    assert len(trace) == len(reference)
    for out, out_off in zip(trace, reference):
        _assert_same_entries(out, out_off)


#: every loss case, by name: a factory returning a ``_LossCase``
LOSS_CASES = {}


def _register(factory, *names, **kwargs):
    """Registers ``factory(loss class, **kwargs)`` under each of ``names``."""
    for name in names:
        cls = getattr(objectives, name.split("-")[0])
        LOSS_CASES[name] = functools.partial(factory, cls, **kwargs)


def _root_only(case):  # ``case``, keeping nothing under "next"
    case.expected = {k: v for k, v in case.expected.items() if k[0] != "next"}
    for keys in case.sub_losses.values():
        keys[:] = [key for key in keys if key in case.expected]
    return case


# ---- PPO, A2C, Reinforce ----
def _multi_agent_data():  # per-agent observations and actions
    data, shape = _rollout(), (BATCH, TIME, 3)
    data["obs"], data["next", "obs"] = torch.randn(2, *shape, OBS_DIM)
    action = torch.rand(*shape, ACT_DIM) * 1.8 - 0.9
    return data.update({"action": action, "action_log_prob": torch.randn(*shape)})


def _actor_critic(shared=False):
    """An actor and a critic; ``shared``: they share a trunk writing ``"hidden"``."""
    if not shared:
        return _gaussian_actor(), _trunk_head("critic_feat", "state_value")
    operator = ActorValueOperator(
        _linear("obs", "hidden", OBS_DIM, OBS_DIM),
        _gaussian_actor(obs_key="hidden"),
        _trunk_head("critic_feat", "state_value", obs_key="hidden"),
    )
    return operator.get_policy_operator(), operator.get_value_operator()


def _ppo_case(loss_cls, data=_ppo_data, shared=False, moved=None, **kw):
    """A loss on an actor and a critic; ``moved``: a target network that differs."""
    # a shared trunk's "hidden" is the actor's (the critic runs it detached)
    moved = moved and f"target_{moved}_network_params"
    critic_keys = ["critic_feat", "hidden"][: 1 + shared]
    expected = {"actor_feat": "actor_network", "critic_feat": "critic_network"}
    expected.update({"hidden": "actor_network"} if shared else {})
    critic = ("critic_network", moved if kw.get("delay_value") else None)
    expected.update({("next", key): critic for key in critic_keys})
    return _LossCase(
        lambda: loss_cls(*_actor_critic(shared), **kw),
        data,
        expected,
        {"loss_critic": critic_keys},
        prepare=lambda loss, data: loss.value_estimator(data),
        edit=moved and (lambda loss: getattr(loss, moved).data.add_(1.0)),
    )


_register(_ppo_case, "ClipPPOLoss", "PPOLoss", "KLPENPPOLoss", "ReinforceLoss")
_register(_ppo_case, "A2CLoss")
_register(_ppo_case, "ClipPPOLoss-shared_trunk", shared=True)
_register(_ppo_case, "ClipPPOLoss-separate_losses", shared=True, separate_losses=True)
_register(_ppo_case, "ReinforceLoss-shared_trunk", shared=True, separate_losses=True)
# the proximal policy runs on target parameters: the current one's is kept
_register(_ppo_case, "ClipPPOLoss-delay_actor", delay_actor=True, moved="actor")
_register(_ppo_case, "ReinforceLoss-delay_value", delay_value=True, moved="critic")
_register(_ppo_case, "MAPPOLoss", "IPPOLoss", data=_multi_agent_data)


# ---- SAC, DDPG, TD3, CrossQ, REDQ, TQC, IQL, CQL ----
def _offpolicy_case(loss_cls, value_loss=None, qvalue=_qvalue_network, **kwargs):
    """A loss on an actor, ``qvalue()`` Q-nets and, with ``value``, a value net: the
    actor's outputs but the action are kept, on "next" too (with ``next_params``),
    the Q-nets' on the stored action, not a sampled one."""
    actor, value = kwargs.pop("actor", _gaussian_actor), kwargs.pop("value", False)
    next_actor = ("actor_network", kwargs.pop("next_params", None))
    if actor is _gaussian_actor:  # the SAC family; IQL passes None
        kwargs.setdefault("target_entropy", -float(ACT_DIM))
    if actor is _categorical_actor:  # it takes one-hot actions
        kwargs["action_space"] = "one-hot"
    kwargs = {key: arg for key, arg in kwargs.items() if arg is not None}
    networks = [qvalue] + [lambda: _trunk_head("value_feat", "state_value")] * value
    actor_keys = ["actor_feat"] + ["loc", "scale"] * (actor is _gaussian_actor)
    q_keys = [k for k in ("qvalue_feat", "qaction_feat") if k in qvalue().out_keys]
    expected = dict.fromkeys(actor_keys, "actor_network")
    expected.update({key: _qvalue_entry(key) for key in q_keys})
    expected.update({("next", key): next_actor for key in actor_keys})
    critic_keys = list(expected)[len(actor_keys) :]
    sub_losses = {"actor_loss": actor_keys, value_loss: critic_keys}
    sub_losses = sub_losses if value_loss else {}
    if value:
        expected["value_feat"] = "value_network"
        sub_losses["value_loss"] = ["value_feat"]
    return _LossCase(
        lambda: loss_cls(actor(), *[make() for make in networks], **kwargs),
        _one_hot_transitions if actor is _categorical_actor else _transitions,
        expected,
        sub_losses,
    )


#: the value estimator's target call: the target actor, then the target value net
_TARGETS = [("actor_network", "target_actor_network_params")]
_TARGETS += [("value_network", "target_value_network_params")]


def _sac_v1_case(loss_cls):
    # each Q-net on its own part of the batch; "next": the estimator's target call
    case = _offpolicy_case(loss_cls, "qvalue_v1_loss", value=True)
    for key in ("qvalue_feat", "qaction_feat"):
        case.expected[key] = _qvalue_entry(key, split=True)
    for key in ("actor_feat", "loc", "scale", "value_feat"):
        case.expected["next", key] = _TARGETS
    case.sub_losses["qvalue_v1_loss"].append(("next", "value_feat"))
    return case


def _discrete_sac_case(loss_cls, skip_done=False):
    # the Q-nets' call on the next observation involves no sampled action: kept
    qvalue = functools.partial(_trunk_head, "qvalue_feat", "action_value", N_ACTIONS)
    kwargs = {"actor": _categorical_actor, "num_actions": N_ACTIONS}
    case = _offpolicy_case(loss_cls, "qvalue_loss", qvalue, **kwargs)
    targets = "target_qvalue_network_params"
    case.expected["next", "qvalue_feat"] = _qvalue_entry("qvalue_feat", targets, True)
    case.sub_losses["qvalue_loss"].append(("next", "qvalue_feat"))
    return _skipping_done(case) if skip_done else case


def _skipping_done(case):
    """``case``, skipping the done next states: its loss keeps nothing next."""
    done, make_data = torch.arange(BATCH).unsqueeze(-1) % 2 == 0, case.make_data
    done = {("next", "done"): done, ("next", "terminated"): done}
    case.make_data = lambda: make_data().update(done)
    case.edit = lambda loss: setattr(loss, "skip_done_states", True)
    return _root_only(case)


def _sac_case(loss_cls, value_loss="qvalue_v2_loss", skip_done=False, **kwargs):
    if loss_cls is objectives.TQCLoss:
        kwargs["num_qvalue_nets"] = 3
    case = _offpolicy_case(loss_cls, value_loss, **kwargs)
    return _skipping_done(case) if skip_done else case


def _ddpg_case(loss_cls):
    # the value network on the stored action, not the actor's; "next": targets
    expected = dict.fromkeys(["qvalue_feat", "qaction_feat"], "value_network")
    expected = {"actor_feat": "actor_network", **expected}
    expected.update({("next", k): _TARGETS for k in list(expected)})
    return _LossCase(
        lambda: loss_cls(_deterministic_actor(), _qvalue_network()),
        _transitions,
        expected,
        {"loss_actor": ["actor_feat"], "loss_value": list(expected)[1:]},
    )


def _td3_case(loss_cls):
    # the target actor's call lands under "next", without graph
    value_loss = "qvalue_loss" if "BC" in loss_cls.__name__ else "value_loss"
    kwargs = {"actor": _deterministic_actor, "bounds": (-1.0, 1.0)}
    kwargs["next_params"] = "target_actor_network_params"
    return _offpolicy_case(loss_cls, value_loss, **kwargs)


def _iql_case(loss_cls, **kwargs):
    # "next": the estimator's target value net, not the target Q-nets (which run
    # on the stored action too) nor an actor
    kwargs.update(value=True, target_entropy=None)
    if loss_cls is objectives.DiscreteIQLLoss:
        kwargs["actor"] = _categorical_actor
        kwargs["qvalue"] = lambda: _trunk_head("qvalue_feat", "state_action_value", 3)
    case = _root_only(_offpolicy_case(loss_cls, "qvalue_loss", **kwargs))
    case.expected["next", "value_feat"], case.edit = _TARGETS[1], _shift_targets
    case.sub_losses["qvalue_loss"].append(("next", "value_feat"))
    return case


def _cql_case(loss_cls, **kwargs):
    # no Q-net call on sampled or random actions (cql_loss, the target) is kept
    case = _offpolicy_case(loss_cls, "q_loss", num_random=3, **kwargs)
    case.sub_losses["actor_bc_loss"] = case.sub_losses["actor_loss"]
    return case


def _discrete_cql_case(loss_cls):
    # "next": the estimator's copy of the network; cql_loss runs no network
    expected = {"qvalue_feat": "value_network"}
    expected["next", "qvalue_feat"] = "value_estimator.value_network"
    return _LossCase(
        lambda: loss_cls(_q_value_actor("qvalue_feat"), action_space="one-hot"),
        _one_hot_transitions,
        expected,
        {"value_loss": list(expected)},
    )


_TQC = {"qvalue": lambda: _qvalue_network(5)}  # 5 quantiles
_register(_sac_case, "SACLoss")
_register(_sac_case, "TQCLoss", **_TQC)
_register(_sac_case, "CrossQLoss", value_loss="qvalue_loss")
# REDQ has no public sub-loss; the target Q-nets it draws are not kept
_register(_sac_case, "REDQLoss", value_loss=None, num_qvalue_nets=4)
# SAC skips the done next states, TQC the terminated ones: nothing next kept
_register(_sac_case, "SACLoss-skip_done", skip_done=True)
_register(_sac_case, "TQCLoss-skip_done", skip_done=True, **_TQC)
_register(_discrete_sac_case, "DiscreteSACLoss")
_register(_discrete_sac_case, "DiscreteSACLoss-skip_done", skip_done=True)
_register(_sac_v1_case, "SACLoss-v1")
_register(_ddpg_case, "DDPGLoss")
_register(_td3_case, "TD3Loss", "TD3BCLoss")
_register(_iql_case, "IQLLoss", "DiscreteIQLLoss")
_register(_cql_case, "CQLLoss")
_register(_cql_case, "CQLLoss-max_q_backup", max_q_backup=True)
_register(_discrete_cql_case, "DiscreteCQLLoss")


# ---- DQN, QMixer ----
def _dqn_case(loss_cls, **kwargs):
    """DQNLoss, or DistributionalDQNLoss with 5 atoms."""

    def make_loss():
        if loss_cls is objectives.DQNLoss:
            actor = _q_value_actor("dqn_feat")
            return loss_cls(actor, action_space="one-hot", **kwargs)
        network = _trunk_head("dqn_feat", "action_value", 5 * N_ACTIONS)
        atoms = nn.Unflatten(-1, (5, N_ACTIONS))
        network[1].module = nn.Sequential(network[1].module, atoms)
        support = torch.linspace(-1.0, 1.0, 5)
        actor = DistributionalQValueActor(network, support, action_space="one-hot")
        return loss_cls(actor, gamma=0.9)

    # what is kept on "next" tells the target network from the online one
    expected = {"dqn_feat": "value_network", ("next", "dqn_feat"): _TARGETS[1]}
    roles = {"action_value": "its 'action_value' key"}
    edit = _shift_targets
    return _LossCase(make_loss, _one_hot_transitions, expected, edit=edit, roles=roles)


def _qmixer_case(loss_cls):
    """QMixerLoss, keeping features of the agents' observations and of the state."""
    a, feat, mixer_feat = "agents", ("agents", "qmix_feat"), ("mixer", "state_feat")

    def make_loss():
        keys = ["action", "action_value", "chosen_action_value"]
        keys = {f"{name}_key": (a, name) for name in keys}
        trunk = _trunk_head(feat, (a, "action_value"), N_ACTIONS, (a, "obs"))
        local_value = QValueActor(trunk, action_space="one-hot", **keys)
        mixer = TensorDictSequential(  # the local values' sum, shifted by the state
            _linear("state", mixer_feat, OBS_DIM),
            TensorDictModule(
                lambda value, state: value.sum(-2) + state.mean(-1, keepdim=True),
                [(a, "chosen_action_value"), mixer_feat],
                ["chosen_action_value"],
            ),
        )
        return loss_cls(local_value, mixer, action_space="one-hot")

    def make_data():  # transitions with three agents' entries and a global state
        data, shape = _transitions(), (BATCH, 3)
        for td in (data, data["next"]):
            td["agents"] = TensorDict({"obs": torch.randn(*shape, OBS_DIM)}, shape)
            td["state"] = torch.randn(BATCH, OBS_DIM)
        action = torch.randint(N_ACTIONS, shape)
        data["agents", "action"] = nn.functional.one_hot(action, N_ACTIONS).bool()
        return data

    # laid out [*B, n_agents, ...] as the network writes them; "next": targets
    nets = ["local_value_network", "mixer_network"]
    targets = [(net, f"target_{net}_params") for net in nets]
    expected = {feat: nets[0], mixer_feat: nets, ("next", *feat): targets[0]}
    expected[("next", *mixer_feat)] = targets
    # the agents' entries it reads, and the local values the mixer reads
    roles = {(a, "obs"): "an input of QMixerLoss", (a, "action"): "its 'action' key"}
    roles[(a, "action_value")] = "its 'action_value' key"
    roles[(a, "chosen_action_value")] = "its 'local_value' key"
    return _LossCase(make_loss, make_data, expected, edit=_shift_targets, roles=roles)


_register(_dqn_case, "DQNLoss", "DistributionalDQNLoss")
_register(_dqn_case, "DQNLoss-double_dqn", double_dqn=True)
_register(_qmixer_case, "QMixerLoss")


# ---- GAIL, BC, DT, ACT: they keep through forward only ----
def _gail_case(loss_cls, shape=(BATCH,), **kw):
    def make_loss():
        features = _linear(["observation", "action"], "disc_feat", OBS_DIM + ACT_DIM)
        head = nn.Sequential(nn.Linear(FEAT_DIM, 1), nn.Sigmoid())
        head = TensorDictModule(head, ["disc_feat"], ["d_logits"])
        return loss_cls(TensorDictSequential(features, head), **kw)

    def make_data():  # expert data, and the collector's
        data = TensorDict(batch_size=shape)
        for prefix, shift in (("", 0), ("collector_", 2)):
            data[prefix + "observation"] = torch.randn(*shape, OBS_DIM) + shift
            data[prefix + "action"] = torch.rand(*shape, ACT_DIM) * 2 - 1
        return data

    # the discriminator on the expert data, not on the collector's or interpolations
    expected = {"disc_feat": "discriminator_network"}
    return _LossCase(make_loss, make_data, expected)


def _bc_case(loss_cls, deterministic=False):
    # a stochastic actor keeps all but the action; a deterministic one, padded
    def make_loss():
        if not deterministic:
            return loss_cls(_gaussian_actor())
        loss = loss_cls(_deterministic_actor(), loss_function="l1")
        loss.set_keys(pad_mask="action_is_pad")
        return loss

    pad = torch.eye(BATCH, ACT_DIM, dtype=torch.bool)
    keys = ["actor_feat"] + ["loc", "scale", "action_log_prob"] * (not deterministic)
    expected = dict.fromkeys(keys, "actor_network")
    make_data = functools.partial(_transitions, action_is_pad=pad)
    return _LossCase(make_loss, make_data, expected)


def _dt_case(loss_cls, batch_dims=2):
    # DT losses on ``[B, T]`` segments, or ``[B]`` ones holding ``T`` steps
    def make_loss():
        head = nn.Sequential(nn.Linear(FEAT_DIM, 2 * ACT_DIM), NormalParamExtractor())
        net = TensorDictSequential(
            _linear(["obs", "return_to_go"], "dt_step_feat", OBS_DIM + 1),
            TensorDictModule(lambda x: x.cumsum(-2), ["dt_step_feat"], ["dt_feat"]),
            TensorDictModule(head, ["dt_feat"], ["loc", "scale"]),
        )
        actor = ProbabilisticActor(net, ["loc", "scale"], distribution_class=TanhNormal)
        online = loss_cls is objectives.OnlineDTLoss
        return loss_cls(actor, target_entropy=-2.0) if online else loss_cls(actor)

    def make_data():
        obs, rtg = torch.randn(BATCH, TIME, OBS_DIM), torch.randn(BATCH, TIME, 1)
        action = torch.rand(BATCH, TIME, ACT_DIM) * 1.8 - 0.9
        data = TensorDict(obs=obs, return_to_go=rtg, action=action)
        data.batch_size = [BATCH, TIME][:batch_dims]
        return data.refine_names(..., "time") if batch_dims == 2 else data

    expected = dict.fromkeys(["dt_step_feat", "dt_feat"], "actor_network")
    return _LossCase(make_loss, make_data, expected)


def _act_case(loss_cls, observation="observation"):
    # the policy runs on a tensordict of its own keys: kept into the caller's
    def make_loss():
        latent = nn.Sequential(nn.Linear(FEAT_DIM, 2), NormalParamExtractor())
        policy = TensorDictSequential(
            _linear("observation", "act_feat", OBS_DIM),
            TensorDictModule(latent, ["act_feat"], ["mu", "log_var"]),
            TensorDictModule(  # a toy decoder: the expert chunk, scaled by the latent
                lambda chunk, mu: chunk * mu.unsqueeze(-1),
                ["action_chunk", "mu"],
                ["action_pred"],
            ),
        )
        loss = loss_cls(policy)
        loss.set_keys(observation=observation)
        return loss

    def make_data():
        obs, chunk = torch.randn(BATCH, OBS_DIM), torch.randn(BATCH, 3, ACT_DIM)
        return TensorDict({observation: obs, ("vla_action", "chunk"): chunk}, [BATCH])

    def policy_call(loss, td):
        policy_input = {"observation": td[observation]}
        policy_input["action_chunk"] = td["vla_action", "chunk"]
        return _expected(loss, TensorDict(policy_input), "act_feat", "actor_network")

    # the expert chunk, under the loss's key and the policy's, is never kept
    roles = {("vla_action", "chunk"): "its 'action_chunk' key"}
    roles["action_chunk"] = "an input of actor_network"
    return _LossCase(make_loss, make_data, {"act_feat": policy_call}, roles=roles)


_register(_gail_case, "GAILLoss")
_register(_gail_case, "GAILLoss-sequence", shape=(BATCH, TIME), use_grad_penalty=True)
_register(_bc_case, "BCLoss")
_register(_bc_case, "BCLoss-deterministic", deterministic=True)
_register(_dt_case, "DTLoss", "OnlineDTLoss")
_register(_dt_case, "DTLoss-batch_dims1", "OnlineDTLoss-batch_dims1", batch_dims=1)
_register(_act_case, "ACTLoss")
# the policy runs on its own keys: kept entries land in the caller's input
_register(_act_case, "ACTLoss-pixels", observation="pixels")


class TestKeepKeysEstimators:
    @pytest.mark.parametrize(
        "value,expected",
        [
            (None, []),
            ([], []),
            ("feat", ["feat"]),
            (("critic", "hidden"), [("critic", "hidden")]),
            (["feat", ("critic", "hidden"), "feat"], ["feat", ("critic", "hidden")]),
            *[(v, "keep_keys must be") for v in (True, 0, {"f"}, ["f", 1], [""], ())],
            ([("next", "feat")], "keep_keys must be"),
            (["obs"], (ValueError, "cannot keep 'obs': .* an input of")),
            (["state_value"], (ValueError, "'state_value': .* its 'value' key")),
            (["advantage"], (ValueError, "'advantage': .* its 'advantage' key")),
            (["reward"], (ValueError, "cannot keep 'reward': .* its 'reward' key")),
            (["features"], (KeyError, r"\['features'\].*'feat'")),
        ],
    )
    @pytest.mark.parametrize("name", list(ESTIMATORS))
    def test_keep_keys_set_keys(self, name, value, expected):
        # set_keys stores a list (None: off) or refuses what is no nested key; the
        # next call refuses, before the network runs, a key the estimator reads or
        # no network writes, and else keeps what the network writes
        estimator, assigned = (_estimator(name, _nested_value_net()) for _ in "ab")
        keys = dataclasses.asdict(estimator.tensor_keys)
        if expected == "keep_keys must be":
            with pytest.raises(ValueError, match=expected):
                estimator.set_keys(keep_keys=value, value_target="target")
            assert dataclasses.asdict(estimator.tensor_keys) == keys
            return
        estimator.set_keys(keep_keys=value)
        assigned.tensor_keys.keep_keys = value  # a string is one key, as in set_keys
        data = _rollout().set("hidden", torch.zeros(BATCH, TIME))
        if isinstance(expected, tuple):
            for module in (estimator, assigned):
                with _linear_calls() as calls, pytest.raises(
                    *expected[:1], match=expected[1]
                ):
                    module(data)
                assert calls["calls"] == 0 and "advantage" not in data.keys()
            return
        assigned.set_keys(keep_keys=estimator.tensor_keys.keep_keys)  # round trip
        assert assigned.tensor_keys.keep_keys == expected
        reference = data.clone()
        assigned.tensor_keys.keep_keys = value
        assigned(data)
        for key in expected:  # a missing parent created beside a root entry
            _assert_kept(data, reference, assigned.value_network, key=key)
        assert (data["hidden"] == 0).all()
        estimator.set_keys(keep_keys=None)
        assert dataclasses.asdict(estimator.tensor_keys) == {**keys, "keep_keys": []}

    @pytest.mark.parametrize("device", get_default_devices())
    @pytest.mark.parametrize("functional", [False, True])
    @pytest.mark.parametrize("path", list(PATHS))
    @pytest.mark.parametrize("name", list(ESTIMATORS))
    @pytest.mark.parametrize("keep_keys,grad", [("hidden", False), (["hidden"], True)])
    def test_keep_keys_matches_direct_call(
        self, keep_keys, grad, name, path, functional, device
    ):
        # on every path the estimator keeps what a direct call writes, with the
        # value's graph, and runs its network and writes the rest as when off
        if functional and path.startswith("shifted"):
            pytest.skip("shifted=True refuses distinct params and next params")
        if name == "VTrace" and path == "deactivate_vmap":
            pytest.skip("VTrace has no deactivate_vmap option")
        if name == "MultiAgentGAE" and path.startswith("shifted"):
            pytest.skip("upstream's shifted call runs on other observations (0.14.1)")
        torch.manual_seed(0)
        value_net = _trunk_head("hidden", "state_value").to(device)
        data = _rollout(device=device)
        data["obs"].requires_grad_()
        if name == "MultiAgentGAE":  # 3 agents
            obs = torch.randn(2, BATCH, TIME, 3, OBS_DIM, device=device)
            data["obs"], data["next", "obs"] = obs.requires_grad_().unbind(0)
        reference = data.clone()
        params = TensorDict.from_module(value_net) if functional else None
        kw = {"params": params, "target_params": params.detach()} if functional else {}
        calls, options = [], {"differentiable": grad, **PATHS[path]}
        for keep, td in ((keep_keys, data), (None, reference)):
            estimator = _estimator(name, value_net, keep, **options)
            with _linear_calls() as counter:
                estimator(td, **kw)
            calls.append(counter["calls"])
        assert calls[0] == calls[1]
        _assert_same_entries(data.exclude("hidden", ("next", "hidden")), reference)
        _assert_kept(data, reference, value_net, params)
        keys = ["hidden", "state_value", ("next", "hidden")]
        assert [data[key].requires_grad for key in keys] == [grad, grad, False]

    @pytest.mark.parametrize("chunks", [None, 2])
    @pytest.mark.parametrize("terminated", [True, False])
    @pytest.mark.parametrize("done_at,budget", [((2,), 2), ((1, 3), 1)])
    def test_keep_keys_shifted_done_steps(self, done_at, budget, terminated, chunks):
        # kept next entries are the output on the stored next observation, NaN at a
        # terminated step or displaced one (one slot, two truncations): never run
        kwargs = {"shifted_budget": budget, "value_chunk_size": chunks}
        estimator = _estimator(keep_keys="hidden", shifted=True, **kwargs)
        data = _rollout(done_at=done_at, terminated=terminated)
        stored = data.clone()
        estimator(data)
        expected = _direct(estimator.value_network, stored["next"])["hidden"]
        for step in done_at if terminated else ():
            expected[:, step] = float("nan")
        valid = data["shifted_valid"]
        assert valid.all() == (budget == 2 or terminated)  # only truncations shift
        kept = data["next", "hidden"][valid]
        torch.testing.assert_close(kept, expected[valid], equal_nan=True)
        evaluated = ~data["hidden"].isnan().all(-1)
        assert evaluated[valid].all()
        expected = _direct(estimator.value_network, stored)["hidden"]
        torch.testing.assert_close(data["hidden"][evaluated], expected[evaluated])

    @pytest.mark.parametrize("shifted", [False, True])
    @pytest.mark.parametrize("name", ["TD0", "TD1", "TDLambda", "GAE"])
    def test_keep_keys_nan_next_obs(self, name, shifted):
        # value_estimate keeps next entries (root ones where it computes them); no
        # integer under "next"; a NaN next observation gives NaN next entries and
        # the estimates of off, also when a call under skip_existing recomputes
        torch.manual_seed(0)
        argmax = TensorDictModule(lambda h: h.argmax(-1), ["hidden"], ["argmax"])
        value_net = TensorDictSequential(*_trunk_head("hidden", "state_value"), argmax)
        data, keep = _rollout(done_at=(TIME - 1,)), ["hidden", "argmax"]
        estimate = data.clone()
        _estimator(name, value_net, keep, shifted=shifted).value_estimate(estimate)
        assert ("argmax" in estimate.keys()) == (name == "GAE" and not shifted)
        _assert_kept(estimate, data, value_net, root=name == "GAE")
        data["next", "obs"][:, -1] = float("nan")
        make = functools.partial(_estimator, name, value_net, shifted=shifted)
        estimators = [make(keep_keys=keep), make()]
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
            value = tds[0]["next", "state_value"]
            torch.testing.assert_close(value, expected["state_value"], equal_nan=True)
            assert ("argmax" in tds[0].keys()) == (not shifted)
            if not shifted:
                assert (tds[0]["argmax"] == _direct(value_net, data)["argmax"]).all()
            assert ("next", "argmax") not in _keys(tds[0]) | _keys(estimate)
            kept = ["hidden", "argmax", ("next", "hidden")]
            _assert_same_entries(tds[0].exclude(*kept), tds[1])
            assert not tds[1]["advantage"].isnan().any()


class TestKeepKeysLossModule:
    def test_keep_keys_nested_calls(self):
        # public calls keep into their own input: nested in forward on halves of
        # its input, on a sub-tensordict, on some rows; a subclass (called with
        # td=) trains a term on what super().forward() kept
        class SplitTD3(objectives.TD3Loss):
            def forward(self, td):
                self.actor_loss(td["offline"][:2])  # kept into a temporary
                out = super().forward(td["online"])
                kept = td["online"].get("qvalue_feat", torch.zeros(()))  # if on
                out["loss_aux"] = kept.pow(2).mean()
                self.value_loss(td["offline"])
                return out

            def actor_loss(self, td):  # run by forward: nested calls on halves
                self.halves = td.split(BATCH // 2, 0)
                losses = [super(SplitTD3, self).actor_loss(h) for h in self.halves]
                return sum(loss for loss, _ in losses), losses[0][1]

        loss = _td3_case(SplitTD3).build(["actor_feat", "qvalue_feat"])
        data = TensorDict({k: _transitions() for k in ("online", "offline")}, [BATCH])
        stored = data.clone()
        torch.manual_seed(2)
        out = loss(td=data)
        assert not {"actor_feat", "qvalue_feat"} & set(data.keys())
        for td in (data["online"], data["offline"]):
            assert {"qvalue_feat", ("next", "actor_feat")} <= _keys(td)
            assert "actor_feat" not in td.keys()
        for half, part in zip(loss.halves, stored["online"].split(BATCH // 2, 0)):
            expected = _expected(loss, part, "actor_feat", "actor_network")
            torch.testing.assert_close(half["actor_feat"], expected)
        out["loss_aux"].backward()
        extractor = loss.qvalue_network_params["module", "0", "module", "weight"]
        assert extractor.grad.abs().sum() > 0
        reference = _run(_td3_case(SplitTD3).build(), stored)  # keep_keys off
        _assert_same_entries(
            *(o.exclude("loss_aux").detach() for o in (out, reference))
        )

    def test_keep_keys_threads(self):
        # two threads calling one loss keep into their own input (vmap cannot run
        # in two threads at once)
        case = LOSS_CASES["ClipPPOLoss"]()
        loss = case.build(case.keep_keys)
        loss.make_value_estimator(objectives.ValueEstimators.GAE, deactivate_vmap=True)
        barrier, results = threading.Barrier(2), {}

        def run(seed):
            data = case.data(seed)
            expected = _expected(loss, data, "critic_feat", "critic_network")
            barrier.wait()
            for call in range(10):
                loss(data)
                results[seed, call] = torch.allclose(data.pop("critic_feat"), expected)

        thread = threading.Thread(target=run, args=(2,))
        thread.start()
        run(1)
        thread.join()
        assert results == {(seed, call): True for seed in (1, 2) for call in range(10)}

    def test_keep_keys_off_as_upstream(self):
        # subclasses upstream accepts work as upstream; a loss without keep_keys
        # refuses it; a plain-module actor (the TokenActor pattern) keeps nothing,
        # breaks nothing and protects its in_keys
        base = objectives.LossModule
        keys = dataclasses.make_dataclass("Keys", [("action", str, "a")], slots=True)
        forward = lambda self: TensorDict(loss=torch.zeros(()))
        attrs = {"_AcceptedKeys": keys, "default_keys": keys, "forward": forward}
        no_argument = type("NoArgument", (base,), attrs)()
        assert no_argument()["loss"] == 0
        no_argument.set_keys(action="a2")
        assert no_argument.tensor_keys.action == "a2"
        static = type("Static", (base,), {"forward": staticmethod(lambda td: td)})
        assert isinstance(static(), base)
        l2 = {"l2_loss": lambda self: sum(p.pow(2).sum() for p in self.parameters())}
        aux = type("AuxPPO", (objectives.ClipPPOLoss,), l2)(*_actor_critic())
        assert aux.l2_loss() > 0
        with pytest.raises(ValueError, match="keep_keys is not an accepted"):
            objectives.ExponentialQuadraticCost().set_keys(keep_keys=["hidden"])
        torch.manual_seed(0)
        actor = type("PlainActor", (nn.Linear,), {"in_keys": ["obs"]})(OBS_DIM, 4)
        loc_scale = NormalParamExtractor()  # a positive scale
        actor.get_dist = lambda td: Independent(Normal(*loc_scale(actor(td["obs"]))), 1)
        critic = _actor_critic()[1]
        loss = functools.partial(objectives.ClipPPOLoss, actor, critic)
        losses = [loss(entropy_bonus=False) for _ in "ab"]
        losses[1].set_keys(keep_keys=["critic_feat"])
        data = _ppo_data()
        _assert_same_entries(*[loss(data.clone()) for loss in losses])
        losses[1].set_keys(keep_keys=["obs"])
        with pytest.raises(ValueError, match="cannot keep 'obs'"):
            losses[1](data)

    @pytest.mark.parametrize("name", ["ClipPPOLoss", "DQNLoss"])
    def test_keep_keys_skip_existing(self, name):
        # kept entries are no inputs of the next epoch under skip_existing (with
        # no stored loc and scale, which would keep the actor from running)
        case = LOSS_CASES[name]()
        with set_skip_existing(True):
            traces = [
                _train(case.build(keep_keys), case.data().exclude("loc", "scale"))
                for keep_keys in (None, case.keep_keys)
            ]
        _assert_same_traces(traces[1], traces[0])

    @pytest.mark.skipif(
        sys.platform == "win32" or sys.version_info >= (3, 14),
        reason="torch.compile is not supported on Windows or Python 3.14+",
    )
    def test_keep_keys_compile(self):
        # as many graphs, graph breaks and recompiles as with keep_keys off, and
        # the values of a direct call
        case, counts = LOSS_CASES["DQNLoss"](), []
        for keep_keys in (None, case.keep_keys):
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(case.build(keep_keys), backend="eager")
            data, stored = case.data(), case.data()
            _run(compiled, case.data())
            frames = counters["frames"]["total"]
            _run(compiled, data)
            recompiles = counters["frames"]["total"] - frames
            breaks = sum(counters["graph_break"].values())
            counts.append((counters["stats"]["unique_graphs"], breaks, recompiles))
        assert counts[1] == counts[0], counts
        case.check(compiled, data, stored, case.expected)


class TestKeepKeysLosses:
    @pytest.mark.parametrize("device", get_default_devices())
    @pytest.mark.parametrize("name", list(LOSS_CASES))
    def test_keep_keys_calls(self, name, device):
        # forward, then the sub-losses in turn (as td3.py), for two epochs with an
        # optimizer step after each call: all as with keep_keys off, and each call
        # keeps into its input what direct calls give (forward's with its graph)
        case = dataclasses.replace(LOSS_CASES[name](), device=device)
        for methods in [[None], list(case.sub_losses)][: 1 + bool(case.sub_losses)]:
            runs = []
            for keep_keys in (None, case.keep_keys):
                loss, data = case.build(), case.data()
                loss.tensor_keys.keep_keys = keep_keys  # as set_keys stores it
                if methods != [None] and case.prepare is not None:
                    case.prepare(case.build(), data)
                check = functools.partial(self._check, case, loss, data, data.clone())
                runs.append((_train(loss, data, methods, keep_keys and check), data))
            kept = {k for m in methods for k in case.sub_losses.get(m, case.expected)}
            _assert_same_traces(runs[1][0], runs[0][0])
            _assert_same_entries(*(data.exclude(*kept) for _, data in runs[::-1]))

    @staticmethod
    def _check(case, loss, data, stored, method):
        case.check(loss, data, stored, case.sub_losses.get(method, case.expected))
        params = [p for p in loss.parameters() if p.requires_grad]
        for key in case.expected if method is None else ():  # forward's graph
            value, next_step = data.get(key), _as_tuple(key)[0] == "next"
            assert value.requires_grad != next_step, key
            if not next_step:
                grads = torch.autograd.grad(
                    value.sum(), params, retain_graph=True, allow_unused=True
                )
                assert any(g is not None and g.abs().sum() > 0 for g in grads), key

    @pytest.mark.parametrize("device", get_default_devices())
    @pytest.mark.parametrize("name", list(LOSS_CASES))
    def test_keep_keys_setting(self, name, device):
        # set_keys stores the setting only; the next call refuses what the loss
        # reads, naming its role, or no network writes before any network runs;
        # keywords give nowhere to write, a locked input tensordict's own error
        case = dataclasses.replace(LOSS_CASES[name](), device=device)
        loss = case.build()
        state_keys = set(loss.state_dict())
        loss.set_keys(keep_keys=case.keep_keys)
        assert set(loss.state_dict()) == state_keys  # no value estimator built
        fields = dataclasses.fields(loss.tensor_keys)
        other = next(f.name for f in fields if f.name != "keep_keys")
        loss.set_keys(**{other: getattr(loss.tensor_keys, other)})
        rebuilt = case.build(loss.tensor_keys.keep_keys)
        assert loss.tensor_keys.keep_keys == rebuilt.tensor_keys.keep_keys
        assert rebuilt.tensor_keys.keep_keys == case.keep_keys
        data = case.data()
        present = [key for key in loss.in_keys if key in data.keys(True)]
        kwargs = {"_".join(_as_tuple(unravel_key(k))): data.get(k) for k in present}
        # what it reads: its keys and the inputs of its networks, off "next"
        reads = dataclasses.asdict(loss.tensor_keys)
        reads = [v for k, v in reads.items() if k != "keep_keys"] + loss.in_keys
        reads = {_as_tuple(unravel_key(k)) for k in reads if k}
        reads = {unravel_key(k[1:] if k[0] == "next" else k) for k in reads}
        with _linear_calls() as counter:
            with pytest.raises(TypeError, match="called without a tensordict"):
                loss(**kwargs)
            for key in {*reads, *case.roles}:
                role = case.roles.get(key, "")
                loss.set_keys(keep_keys=[*case.keep_keys, key])
                message = f"{type(loss).__name__} cannot keep {key!r}: "
                message += f"it is, holds or is inside {role}"
                with pytest.raises(ValueError, match=re.escape(message)):
                    _run(loss, data)
            loss.set_keys(keep_keys=["no_such_entry"])
            with pytest.raises(KeyError, match=r"\['no_such_entry'\].*They write"):
                _run(loss, data)
        assert counter["calls"] == 0
        assert not set(case.expected) & _keys(data)
        with pytest.raises(RuntimeError, match="locked"):
            _run(case.build(case.keep_keys), data.lock_())


if __name__ == "__main__":
    args, unknown = argparse.ArgumentParser().parse_known_args()
    pytest.main([__file__, "--capture", "no", "--exitfirst"] + unknown)
