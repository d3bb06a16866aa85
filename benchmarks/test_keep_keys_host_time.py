"""The host time keep_keys adds to one loss call, and to one update, with tiny networks.

With networks this small (8 hidden units, 8 transitions, one thread) a call
is almost all Python, as a step is on a GPU under CUDA graphs: what keep_keys
adds is its own bookkeeping. Each round times ``CALLS`` forward calls (or
updates: loss, backward, optimizer step) with keep_keys off and ``CALLS``
with it on, in alternating order, and stores the difference of their means;
``extra_info["added_us"]`` is the median over the rounds, in microseconds
per call.

Run with ``python -m pytest -o addopts= -p no:xdist benchmarks/test_keep_keys_host_time.py``;
``python benchmarks/report.py`` prints the figures.
"""

import statistics
import time

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torchrl.modules import ProbabilisticActor, TanhNormal
from torchrl.objectives import ClipPPOLoss, SACLoss

ROUNDS = 40
CALLS = 25
BATCH, OBS, ACT, HIDDEN = 8, 3, 2, 8


def _linear(in_keys, out_key, in_features, out_features):
    class Cat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(in_features, out_features)

        def forward(self, *inputs):
            return self.linear(torch.cat(inputs, -1))

    return TensorDictModule(Cat(), in_keys=in_keys, out_keys=[out_key])


def _actor():
    return ProbabilisticActor(
        TensorDictSequential(
            _linear(["observation"], "actor_feat", OBS, HIDDEN),
            TensorDictModule(
                torch.nn.Sequential(
                    torch.nn.Linear(HIDDEN, 2 * ACT), NormalParamExtractor()
                ),
                in_keys=["actor_feat"],
                out_keys=["loc", "scale"],
            ),
        ),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        return_log_prob=True,
    )


def _clip_ppo():
    critic = TensorDictSequential(
        _linear(["observation"], "critic_feat", OBS, HIDDEN),
        _linear(["critic_feat"], "state_value", HIDDEN, 1),
    )
    loss = ClipPPOLoss(_actor(), critic)
    loss.make_value_estimator(gamma=0.99, lmbda=0.95)
    return loss, ["actor_feat", "critic_feat"]


def _sac():
    qvalue = TensorDictSequential(
        _linear(["observation", "action"], "q_feat", OBS + ACT, HIDDEN),
        _linear(["q_feat"], "state_action_value", HIDDEN, 1),
    )
    loss = SACLoss(_actor(), qvalue, num_qvalue_nets=2, target_entropy=-float(ACT))
    loss.make_value_estimator(gamma=0.99)
    return loss, ["actor_feat", "q_feat"]


def _data():
    gen = torch.Generator().manual_seed(0)
    done = torch.zeros(BATCH, 1, dtype=torch.bool)
    return TensorDict(
        observation=torch.randn(BATCH, OBS, generator=gen),
        action=torch.rand(BATCH, ACT, generator=gen).mul(1.8).sub(0.9),
        action_log_prob=torch.randn(BATCH, generator=gen),
        next=TensorDict(
            observation=torch.randn(BATCH, OBS, generator=gen),
            reward=torch.randn(BATCH, 1, generator=gen),
            done=done,
            terminated=done.clone(),
            batch_size=[BATCH],
        ),
        batch_size=[BATCH],
    )


CASES = {"ClipPPOLoss+GAE": _clip_ppo, "SACLoss v2": _sac}


def _forward(loss, td):
    loss(td)


def _update(loss, td):
    # a whole step, as a GPU user pays it under CUDA graphs: loss, backward,
    # optimizer step (the optimizer is made at the first step)
    if "_bench_optim" not in loss.__dict__:
        loss.__dict__["_bench_optim"] = torch.optim.Adam(loss.parameters())
    losses = loss(td)
    sum(v for k, v in losses.items() if k.startswith("loss_")).backward()
    loss.__dict__["_bench_optim"].step()
    loss.__dict__["_bench_optim"].zero_grad()


@pytest.mark.parametrize("step", [_forward, _update], ids=["forward", "update"])
@pytest.mark.parametrize("name", list(CASES))
def test_keep_keys_host_time(benchmark, name, step):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    off, keep = CASES[name]()
    on = CASES[name]()[0]
    on.set_keys(keep_keys=keep)
    data = _data()
    inputs = [data.clone() for _ in range(CALLS)]
    added = []

    def mean_call(loss):
        batches = [td.clone() for td in inputs]
        start = time.perf_counter()
        for td in batches:
            step(loss, td)
        return (time.perf_counter() - start) / CALLS

    def one_round():
        first, second = (off, on) if len(added) % 2 else (on, off)
        times = {first: mean_call(first), second: mean_call(second)}
        added.append(times[on] - times[off])

    for _ in range(3):  # warm-up
        one_round()
    added.clear()
    benchmark.group = "keep_keys host time"
    benchmark.pedantic(one_round, rounds=ROUNDS)
    benchmark.extra_info["added_us"] = statistics.median(added) * 1e6
