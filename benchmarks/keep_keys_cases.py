"""Losses and estimators with sizeable feature extractors, for the keep_keys benchmarks.

Each case builds a module whose actor and critic start with a 3-layer MLP of
width 256 (the "feature extractor") and data for it, and offers four steps:

- ``off``: forward + backward with keep_keys unset;
- ``on``: the same with keep_keys set to the extractors' outputs;
- ``on_aux``: ``on`` plus an auxiliary loss on the kept features;
- ``workaround_aux``: keep_keys unset, the extractors run a second time to get
  the features, and the same auxiliary loss on those;
- ``extractors``: that second extractor pass and its auxiliary loss alone.

Timings use one thread, which keeps them stable on a small shared machine;
the ratios are what the benchmarks report.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal
from torchrl.objectives import ClipPPOLoss, DDPGLoss, SACLoss, TD3Loss
from torchrl.objectives.value import GAE

torch.set_num_threads(1)

OBS, ACT, WIDTH = 32, 4, 256
BATCH, TIME = 8, 32


def extractor(in_keys, out_key, in_features):
    net = MLP(
        in_features=in_features, out_features=WIDTH, num_cells=[WIDTH] * 2, depth=2
    )
    if len(in_keys) > 1:
        body = net
        net = _Concat(body)
    return TensorDictModule(net, in_keys=in_keys, out_keys=[out_key])


class _Concat(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, *inputs):
        return self.body(torch.cat(inputs, -1))


def make_actor(stochastic=True):
    feat = extractor(["observation"], "actor_feat", OBS)
    if not stochastic:
        head = TensorDictModule(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, ACT), torch.nn.Tanh()),
            in_keys=["actor_feat"],
            out_keys=["action"],
        )
        return TensorDictSequential(feat, head), feat
    head = TensorDictModule(
        torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * ACT), NormalParamExtractor()),
        in_keys=["actor_feat"],
        out_keys=["loc", "scale"],
    )
    actor = ProbabilisticActor(
        TensorDictSequential(feat, head),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )
    return actor, feat


def make_state_value():
    feat = extractor(["observation"], "critic_feat", OBS)
    head = TensorDictModule(torch.nn.Linear(WIDTH, 1), ["critic_feat"], ["state_value"])
    return TensorDictSequential(feat, head), feat


def make_action_value():
    feat = extractor(["observation", "action"], "q_feat", OBS + ACT)
    head = TensorDictModule(
        torch.nn.Linear(WIDTH, 1), ["q_feat"], ["state_action_value"]
    )
    return TensorDictSequential(feat, head), feat


def make_data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = (BATCH, TIME)
    done = torch.zeros(*batch, 1, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict(
        observation=torch.randn(*batch, OBS, generator=gen),
        action=torch.rand(*batch, ACT, generator=gen).mul(2).sub(1).clamp(-0.99, 0.99),
        action_log_prob=torch.randn(*batch, generator=gen),
        next=TensorDict(
            observation=torch.randn(*batch, OBS, generator=gen),
            reward=torch.randn(*batch, 1, generator=gen),
            done=done,
            terminated=done.clone(),
            batch_size=batch,
        ),
        batch_size=batch,
        names=[None, "time"],
    )


def aux_loss(features):
    return sum(f.pow(2).mean() for f in features) * 1e-3


class Case:
    """One module under test; ``step(mode)`` runs one forward + backward."""

    name: str
    keep: list[str]

    def __init__(self):
        torch.manual_seed(0)
        self.data = make_data()
        self.module, self.extractors = self.build()
        self._keeping = False

    def build(self):
        raise NotImplementedError

    def run(self, td):
        out = self.module(td)
        return sum(v for k, v in out.items() if k.startswith("loss_"))

    def refeaturize(self, td):
        """The workaround: the feature extractors run again on the stored data."""
        return [
            ex(td.select(*ex.in_keys).clone())[ex.out_keys[0]] for ex in self.extractors
        ]

    def prepare(self, mode):
        """Sets keep_keys for ``mode``: once, as a user does, and untimed.

        keep_keys is validated in ``set_keys``; the benchmarks call this before
        they start the clock, so that a step times the loss alone. In "off"
        mode keep_keys is never touched, so that stock torchrl runs it too.
        """
        on = mode in ("on", "on_aux")
        if on != self._keeping:
            self.module.set_keys(keep_keys=self.keep if on else None)
            self._keeping = on

    def step(self, mode):
        if mode == "extractors":
            return self.extractors_only()
        td = self.data.clone()
        self.prepare(mode)
        loss = self.run(td)
        if mode == "on_aux":
            loss = loss + aux_loss([td[k] for k in self.keep])
        elif mode == "workaround_aux":
            loss = loss + aux_loss(self.refeaturize(td))
        self._backward(loss)
        return td

    def extractors_only(self):
        """The extractors' own share of the workaround: forward, aux loss, backward."""
        self._backward(aux_loss(self.refeaturize(self.data.clone())))

    def _backward(self, loss):
        if loss.requires_grad:
            loss.backward()
        self.module.zero_grad(set_to_none=True)


class ClipPPOCase(Case):
    name = "ClipPPOLoss+GAE"
    keep = ["actor_feat", "critic_feat"]

    def build(self):
        actor, actor_feat = make_actor()
        critic, critic_feat = make_state_value()
        loss = ClipPPOLoss(actor, critic)
        loss.make_value_estimator(gamma=0.99, lmbda=0.95)
        return loss, [actor_feat, critic_feat]


class SACCase(Case):
    name = "SACLoss"
    keep = ["actor_feat", "q_feat"]

    def build(self):
        actor, actor_feat = make_actor()
        qvalue, q_feat = make_action_value()
        loss = SACLoss(actor, qvalue, num_qvalue_nets=2, target_entropy=-float(ACT))
        loss.make_value_estimator(gamma=0.99)
        return loss, [actor_feat, q_feat]

    def refeaturize(self, td):
        # one extractor pass per Q-net, as the loss runs one per ensemble member
        actor_feat, q_feat = self.extractors
        feats = [actor_feat(td.select("observation").clone())["actor_feat"]]
        for _ in range(self.module.num_qvalue_nets):
            feats.append(q_feat(td.select("observation", "action").clone())["q_feat"])
        return feats


class TD3Case(SACCase):
    name = "TD3Loss"

    def build(self):
        actor, actor_feat = make_actor(stochastic=False)
        qvalue, q_feat = make_action_value()
        loss = TD3Loss(actor, qvalue, bounds=(-1.0, 1.0), num_qvalue_nets=2)
        loss.make_value_estimator(gamma=0.99)
        return loss, [actor_feat, q_feat]


class DDPGCase(Case):
    name = "DDPGLoss"
    keep = ["actor_feat", "q_feat"]

    def build(self):
        actor, actor_feat = make_actor(stochastic=False)
        value, q_feat = make_action_value()
        loss = DDPGLoss(actor, value)
        loss.make_value_estimator(gamma=0.99)
        return loss, [actor_feat, q_feat]


class GAECase(Case):
    name = "GAE"
    keep = ["critic_feat"]
    #: estimator options; the layout cases below set the paths they check
    options = {}

    def build(self):
        critic, critic_feat = make_state_value()
        gae = GAE(gamma=0.99, lmbda=0.95, value_network=critic, **self.options)
        return gae, [critic_feat]

    def run(self, td):
        self.module(td)
        return td["advantage"].sum()

    def refeaturize(self, td):
        # the estimator is not differentiable: its features carry no graph
        ex = self.extractors[0]
        with torch.no_grad():
            return [
                ex(td.select("observation").clone())["critic_feat"],
                ex(td["next"].select("observation").clone())["critic_feat"],
            ]


CASES = [ClipPPOCase, SACCase, TD3Case, DDPGCase, GAECase]
MODES = ["off", "on", "on_aux", "workaround_aux", "extractors"]


class GAEChunkedCase(GAECase):
    name = "GAE, value_chunk_size=4"
    options = {"value_chunk_size": 4}


class GAEShiftedCase(GAECase):
    name = "GAE, shifted=True"
    options = {"shifted": True}


#: estimator paths whose layout is checked for storage sharing only
LAYOUT_CASES = [GAEChunkedCase, GAEShiftedCase]
