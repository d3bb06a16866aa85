"""keep_keys where users meet it: TorchRL 0.14.1's own ``Trainer`` and its Ray learner.

A fork-level module, not part of the upstream series. It trains the pattern
that KEEP_KEYS.md (v3) recommends for an auxiliary loss: a ``ClipPPOLoss``
subclass whose ``forward`` adds a term on the critic's kept features, the
critic being a feature extractor (writing ``"critic_features"``) and a head.

* ``test_local_trainer_trains_an_auxiliary_loss_on_kept_features``: the local
  ``Trainer`` on TorchRL's built-in ``PendulumEnv`` with a ``Collector``. The
  term is logged, moves the extractor by exactly its own gradient, and leaves
  the shared loss terms bitwise unchanged; a Trainer hook logs the features.
* ``test_kept_entries_stored_from_a_trainer_hook_keep_their_graph``: a batch
  stored after the loss ran on it keeps the graph (the documented caveat), and
  the documented fixes (exclude, or extend under ``no_grad``) drop it.
* ``test_ddp_ranks_get_the_mean_gradient_of_the_auxiliary_loss`` (slow,
  invariant 6): the loss wrapped as the Trainer's learner wraps it for DDP, on
  2 gloo ranks spawned on this machine.
* ``test_ray_learner_trains_the_auxiliary_loss_on_two_ranks`` (slow): the same
  training through ``Trainer(learner_backend="ray")`` with 2 gloo ranks, checked
  against a replay of the learner's steps in this process.
* ``test_readme_training_section_comes_from_these_tests``: the README section
  "## Training with keep_keys" shows only code that runs here.

Every process and server these tests start stays on this machine: DDP meets
through a file store, Ray is started with local resources on loopback.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.checkpoint import Checkpoint
from torchrl.collectors import Collector
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from torchrl.envs import (
    CatTensors,
    Compose,
    PendulumEnv,
    StepCounter,
    TransformedEnv,
    UnaryTransform,
)
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal
from torchrl.objectives import ClipPPOLoss
from torchrl.record.loggers import Logger
from torchrl.trainers import DefaultOptimizationStepper, Trainer

# the two pieces the Trainer's learner uses to put a loss under DDP
from torchrl.trainers._distributed import _DDPProcessGroup
from torchrl.trainers._execution import _LossForwarder

TEST_DIR = Path(__file__).resolve().parent
README = TEST_DIR.parent / "README.md"
README_SECTION = "## Training with keep_keys"

SEED = 0
HIDDEN = 16
LR = 1e-2
# local Trainer: one optimization step per collected batch
FRAMES_PER_BATCH = 64
LOCAL_STEPS = 3
# DDP and the Ray learner: each of the 2 ranks gets this many transitions
RANK_BATCH = 16
RAY_STEPS = 3
# one collection feeds the whole Ray round: every transition is used once
RAY_FRAMES = 2 * RANK_BATCH * RAY_STEPS
# a rank that hangs fails the test instead of the session
PROCESS_TIMEOUT = 120.0
# where the extractor's parameters sit in the loss's state_dict
EXTRACTOR_PREFIX = "critic_network_params.module.0.module."


# the pattern under test (the README shows it verbatim)
class AuxPPOLoss(ClipPPOLoss):
    def forward(self, tensordict):
        out = super().forward(tensordict)
        out["loss_aux"] = tensordict["critic_features"].pow(2).mean()
        return out


def _cos(th):
    return th.cos().unsqueeze(-1)


def _sin(th):
    return th.sin().unsqueeze(-1)


def _unsqueeze(x):
    return x.unsqueeze(-1)


def make_env(seed: int = SEED) -> TransformedEnv:
    """One pendulum observing ``[cos th, sin th, thdot]``.

    Module-level functions, not lambdas: Ray's collector actor unpickles this.
    """
    return TransformedEnv(
        PendulumEnv(seed=seed),
        Compose(
            UnaryTransform(in_keys=["th"], out_keys=["cos_th"], fn=_cos),
            UnaryTransform(in_keys=["th"], out_keys=["sin_th"], fn=_sin),
            UnaryTransform(in_keys=["thdot"], out_keys=["thdot_obs"], fn=_unsqueeze),
            CatTensors(
                in_keys=["cos_th", "sin_th", "thdot_obs"],
                out_key="observation",
                sort=False,
            ),
            # Pendulum never terminates on its own
            StepCounter(max_steps=200),
        ),
    )


def make_actor_critic():
    """A small actor, and a critic made of a feature extractor and a head."""
    action_spec = PendulumEnv().full_action_spec_unbatched["action"]
    actor = ProbabilisticActor(
        TensorDictModule(
            nn.Sequential(
                MLP(in_features=3, out_features=2, num_cells=[HIDDEN]),
                NormalParamExtractor(),
            ),
            in_keys=["observation"],
            out_keys=["loc", "scale"],
        ),
        in_keys=["loc", "scale"],
        spec=action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={
            "low": action_spec.space.low,
            "high": action_spec.space.high,
        },
        return_log_prob=True,
    )
    critic = TensorDictSequential(
        TensorDictModule(
            nn.Sequential(nn.Linear(3, HIDDEN), nn.Tanh()),
            in_keys=["observation"],
            out_keys=["critic_features"],
        ),
        TensorDictModule(
            nn.Linear(HIDDEN, 1),
            in_keys=["critic_features"],
            out_keys=["state_value"],
        ),
    )
    return actor, critic


def make_loss(loss_cls: type[ClipPPOLoss]) -> ClipPPOLoss:
    """``loss_cls`` (GAE by default) on a fresh actor and critic, keeping the features.

    No entropy bonus: TanhNormal's entropy is a Monte-Carlo estimate, and
    without it the loss is a function of the parameters and the batch only, so
    what other processes compute can be replayed in this one.
    """
    actor, critic = make_actor_critic()
    loss = loss_cls(actor, critic, entropy_bonus=False)
    loss.set_keys(keep_keys=["critic_features"])
    return loss


def extractor_state(loss_state: dict) -> dict[str, torch.Tensor]:
    """The extractor's entries of a loss ``state_dict``, named as in ``nn.Sequential``."""
    return {
        key[len(EXTRACTOR_PREFIX) :]: value.detach().clone()
        for key, value in loss_state.items()
        if key.startswith(EXTRACTOR_PREFIX)
    }


def extractor_from_state(state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain copy of the critic's extractor, to compute references with."""
    extractor = nn.Sequential(nn.Linear(3, HIDDEN), nn.Tanh())
    extractor.load_state_dict(state)
    return extractor


def loss_sum(losses) -> torch.Tensor:
    # what the Trainer's optimization stepper backpropagates
    return sum(value for key, value in losses.items() if key.startswith("loss"))


class MemoryLogger(Logger):
    """Keeps every scalar the Trainer logs, in order, by name."""

    def __init__(self) -> None:
        self.scalars = defaultdict(list)
        super().__init__(exp_name="memory", log_dir="")

    def _create_experiment(self) -> None:
        return None

    def log_scalar(self, name, value, step=None) -> None:
        self.scalars[name].append(torch.as_tensor(value).detach().clone())

    def log_video(self, name, video, step=None, **kwargs) -> None:
        raise AssertionError("these tests log no video")

    def log_hparams(self, cfg) -> None:
        return None

    def __repr__(self) -> str:
        return "MemoryLogger()"

    def log_histogram(self, name, data, **kwargs) -> None:
        raise AssertionError("these tests log no histogram")


# --------------------------------------------------------------------------
# The local Trainer
# --------------------------------------------------------------------------


@dataclass
class LocalRun:
    """What one local training run logged, saw and left behind."""

    initial_extractor: dict[str, torch.Tensor]
    logged: dict = field(default_factory=dict)
    observations: list = field(default_factory=list)
    extractor_after_step: list = field(default_factory=list)

    def extractor_before_step(self, step: int) -> nn.Module:
        if step == 0:
            return extractor_from_state(self.initial_extractor)
        return extractor_from_state(self.extractor_after_step[step - 1])


def train_locally(loss_cls: type[ClipPPOLoss], hooks=()) -> LocalRun:
    """``LOCAL_STEPS`` steps of the local Trainer, seeded: two calls differ only by ``loss_cls``."""
    torch.manual_seed(SEED)
    env = make_env()
    loss = make_loss(loss_cls)
    run = LocalRun(initial_extractor=extractor_state(loss.state_dict()))
    collector = Collector(
        env,
        loss.actor_network,
        frames_per_batch=FRAMES_PER_BATCH,
        total_frames=FRAMES_PER_BATCH * LOCAL_STEPS,
        # a stateless actor: no automatic InitTracker
        auto_register_policy_transforms=False,
    )
    logger = MemoryLogger()
    trainer = Trainer(
        collector=collector,
        total_frames=FRAMES_PER_BATCH * LOCAL_STEPS,
        frame_skip=1,
        # one step per batch: the logged losses are those of that step
        optim_steps_per_batch=1,
        loss_module=loss,
        optimizer=torch.optim.SGD(loss.parameters(), lr=LR),
        # the stepper the Ray learner runs too (instead of the OptimizerHook)
        optimization_stepper=DefaultOptimizationStepper(),
        logger=logger,
        log_interval=0,
        progress_bar=False,
        seed=SEED,
    )

    def log_critic_features(batch):
        return {"critic_features_mean": batch["critic_features"].mean().item()}

    trainer.register_op("post_optim_log", log_critic_features)

    # instrumentation, for the references: each step's data and result
    def record_observations(batch):
        run.observations.append(batch["observation"].clone())

    def record_extractor():
        run.extractor_after_step.append(extractor_state(loss.state_dict()))

    trainer.register_op("batch_process", record_observations)
    trainer.register_op("post_optim", record_extractor)
    for dest, op in hooks:
        trainer.register_op(dest, op)
    trainer.train()
    run.logged = dict(logger.scalars)
    return run


def test_local_trainer_trains_an_auxiliary_loss_on_kept_features():
    aux = train_locally(AuxPPOLoss)
    # the same run, seed and keep_keys, without the auxiliary term
    plain = train_locally(ClipPPOLoss)
    assert len(aux.observations) == len(plain.observations) == LOCAL_STEPS
    # both runs start from the same batch
    assert torch.equal(aux.observations[0], plain.observations[0])

    # the term reaches the Trainer's log, every step, and only in the aux run
    assert "loss_aux" not in plain.logged
    assert len(aux.logged["loss_aux"]) == LOCAL_STEPS
    for run in (aux, plain):
        assert len(run.logged["critic_features_mean"]) == LOCAL_STEPS
        for step in range(LOCAL_STEPS):
            # the extractor as the step's loss saw it, on the step's batch
            with torch.no_grad():
                features = run.extractor_before_step(step)(run.observations[step])
            # the hook read the kept entry the loss wrote into the batch
            torch.testing.assert_close(
                run.logged["critic_features_mean"][step],
                features.mean(),
            )
            if run is aux:
                torch.testing.assert_close(
                    run.logged["loss_aux"][step], features.pow(2).mean()
                )

    # first step: the loss terms both runs have are bitwise the same
    shared = set(plain.logged) - {"grad_norm", "optim_steps", "critic_features_mean"}
    assert {"loss_objective", "loss_critic"} <= shared
    for key in sorted(shared):
        assert torch.equal(aux.logged[key][0], plain.logged[key][0]), key
    # while the gradient, which has the auxiliary term's in it, does not
    assert not torch.equal(aux.logged["grad_norm"][0], plain.logged["grad_norm"][0])

    # after that step the extractor moved by exactly -lr * grad(loss_aux)
    extractor = extractor_from_state(aux.initial_extractor)
    aux_term = extractor(aux.observations[0]).pow(2).mean()
    names, params = zip(*extractor.named_parameters())
    aux_grads = dict(zip(names, torch.autograd.grad(aux_term, params)))
    for name in names:
        torch.testing.assert_close(
            aux.extractor_after_step[0][name] - plain.extractor_after_step[0][name],
            -LR * aux_grads[name],
            rtol=1e-4,
            atol=2e-7,
        )
    # and the trained extractors differ
    for name in names:
        assert not torch.equal(
            aux.extractor_after_step[-1][name], plain.extractor_after_step[-1][name]
        ), name


def test_kept_entries_stored_from_a_trainer_hook_keep_their_graph():
    """Storing a batch the loss ran on keeps the graph; the documented fixes drop it.

    A ``post_steps_log`` hook gets the collected batch after the loss ran on
    it: with the local Trainer, that is the very tensordict the loss wrote into.
    """
    as_is = ReplayBuffer(storage=LazyTensorStorage(FRAMES_PER_BATCH * LOCAL_STEPS))
    excluded = ReplayBuffer(storage=LazyTensorStorage(FRAMES_PER_BATCH * LOCAL_STEPS))
    detached = ReplayBuffer(storage=LazyTensorStorage(FRAMES_PER_BATCH * LOCAL_STEPS))

    def store(batch):
        # the caveat: the stored entries hold the loss's graph
        as_is.extend(batch)
        # the fixes
        excluded.extend(batch.exclude("critic_features", ("next", "critic_features")))
        with torch.no_grad():
            detached.extend(batch)

    run = train_locally(AuxPPOLoss, hooks=[("post_steps_log", store)])
    # what the loss kept, step by step: each step's extractor on its batch
    with torch.no_grad():
        expected = torch.cat(
            [
                run.extractor_before_step(step)(run.observations[step])
                for step in range(LOCAL_STEPS)
            ]
        )

    stored = as_is[:]
    assert stored["critic_features"].grad_fn is not None
    assert as_is.sample(8)["critic_features"].requires_grad
    torch.testing.assert_close(stored["critic_features"].detach(), expected)

    stored = excluded[:]
    assert not any(value.requires_grad for value in stored.values(True, True))
    assert set(stored.keys(True, True)) == set(as_is[:].keys(True, True)) - {
        "critic_features",
        ("next", "critic_features"),
    }

    stored = detached[:]
    assert not any(value.requires_grad for value in stored.values(True, True))
    torch.testing.assert_close(stored["critic_features"], expected)


# --------------------------------------------------------------------------
# DDP, as the Trainer's learner wraps a loss (KEEP_KEYS.md invariant 6)
# --------------------------------------------------------------------------


def test_kept_entries_cloned_past_an_update_stay_that_steps():
    """The README's clone keeps a step's features past the next step.

    Under CUDA graphs the next replay overwrites kept entries; the clone is
    what survives it. Here ``update`` is eager (no GPU on CI): the test checks
    that the cloned entries are the step's own. What happens without the
    clone under CUDA graphs is not tested here (no GPU was lent to this work).
    """
    loss = make_loss(AuxPPOLoss)
    optimizer = torch.optim.Adam(loss.parameters(), lr=0.1)

    def update(batch):
        out = loss(batch)
        loss_sum(out).backward()
        optimizer.step()
        optimizer.zero_grad()
        return out.detach()

    kept = []
    for step in range(2):
        batch = make_fixed_batch(step)
        with torch.no_grad():
            expected = extractor_from_state(extractor_state(loss.state_dict()))(
                batch["observation"]
            )
        loss_td = update(batch).clone()
        critic_features = batch["critic_features"].clone()
        kept.append((loss_td, critic_features, expected))
    for loss_td, critic_features, expected in kept:
        torch.testing.assert_close(critic_features.detach(), expected)
        assert loss_td["loss_aux"] == critic_features.pow(2).mean()


def make_fixed_batch(seed: int) -> TensorDict:
    """``RANK_BATCH`` consecutive Pendulum-like transitions; an episode ends midway."""
    generator = torch.Generator().manual_seed(seed)
    observation = torch.randn(RANK_BATCH + 1, 3, generator=generator)
    terminated = torch.zeros(RANK_BATCH, 1, dtype=torch.bool)
    terminated[RANK_BATCH // 2] = True
    return TensorDict(
        {
            "observation": observation[:-1],
            # inside the open interval (-2, 2) where TanhNormal has a density
            "action": torch.rand(RANK_BATCH, 1, generator=generator) * 3.0 - 1.5,
            "action_log_prob": torch.randn(RANK_BATCH, generator=generator),
            "next": {
                "observation": observation[1:],
                "reward": torch.randn(RANK_BATCH, 1, generator=generator),
                "done": terminated.clone(),
                "terminated": terminated,
            },
        },
        batch_size=[RANK_BATCH],
    )


def _loopback_interface() -> str | None:
    """The loopback interface's name, for gloo (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def _ddp_rank(rank, world_size, store_file, loss_state, batches, out_dir):
    """One rank: the loss under DDP as ``_Learner.initialize`` puts it, one backward."""
    store = dist.FileStore(store_file, world_size)
    group = _DDPProcessGroup.create(
        rank=rank,
        local_rank=0,
        world_size=world_size,
        store=store,
        backend="gloo",
        timeout=PROCESS_TIMEOUT,
    )
    loss = make_loss(AuxPPOLoss)
    loss.load_state_dict(loss_state)
    ddp_loss = group.wrap(_LossForwarder(loss))
    batch = batches[rank]
    losses, _ = ddp_loss(batch)
    loss_sum(losses).backward()
    torch.save(
        {
            "grads": {name: p.grad for name, p in loss.named_parameters()},
            "losses": losses.detach(),
            "kept": batch.select(
                "critic_features", ("next", "critic_features")
            ).detach(),
            "kept_has_graph": batch["critic_features"].grad_fn is not None,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    group.close()
    # Leave without freeing the DDP wrapper: torch 2.13 frees its gloo process
    # group holding the GIL and joins gloo's worker threads, and a worker that
    # is still freeing the allreduce it ran waits for the GIL. On a busy machine
    # (the Ray test in the other xdist worker) that deadlock hung this rank.
    os._exit(0)


def reference_grads(loss: ClipPPOLoss, batch: TensorDict):
    """Losses and gradients of one process on one batch."""
    loss.zero_grad()
    losses = loss(batch.clone())
    loss_sum(losses).backward()
    grads = {name: p.grad.clone() for name, p in loss.named_parameters()}
    loss.zero_grad()
    return losses.detach(), grads


@pytest.mark.slow
def test_ddp_ranks_get_the_mean_gradient_of_the_auxiliary_loss(tmp_path, monkeypatch):
    world_size = 2
    torch.manual_seed(SEED)
    loss = make_loss(AuxPPOLoss)
    loss_state = copy.deepcopy(loss.state_dict())
    batches = [make_fixed_batch(SEED + rank) for rank in range(world_size)]

    interface = _loopback_interface()
    if interface is not None:
        # gloo's own connections stay on loopback too
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    context = mp.start_processes(
        _ddp_rank,
        args=(
            world_size,
            str(tmp_path / "store"),
            loss_state,
            batches,
            str(tmp_path),
        ),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + PROCESS_TIMEOUT
    # join raises with the rank's traceback if a rank fails
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the DDP ranks did not finish in {PROCESS_TIMEOUT:.0f} s")
    ranks = [
        torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for rank in range(world_size)
    ]

    # the reference: one process, the same parameters, each rank's batch
    per_rank = [reference_grads(loss, batch) for batch in batches]
    expected = {
        name: torch.stack([grads[name] for _, grads in per_rank]).mean(0)
        for name in per_rank[0][1]
    }
    plain = make_loss(ClipPPOLoss)
    plain.load_state_dict(loss_state)
    plain_grads = [reference_grads(plain, batch)[1] for batch in batches]

    assert set(ranks[0]["grads"]) == set(expected)
    for name in sorted(expected):
        # DDP gives every rank the same gradient...
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
        # ...the mean of what one process computes on each rank's batch
        torch.testing.assert_close(ranks[0]["grads"][name], expected[name])

    # the auxiliary term is in it: on the extractor, the gradient differs
    # from plain PPO's by the mean gradient of features.pow(2).mean()
    extractor = extractor_from_state(extractor_state(loss_state))
    names, params = zip(*extractor.named_parameters())
    aux_grads = [
        torch.autograd.grad(extractor(batch["observation"]).pow(2).mean(), params)
        for batch in batches
    ]
    for index, name in enumerate(names):
        key = EXTRACTOR_PREFIX + name
        plain_mean = (plain_grads[0][key] + plain_grads[1][key]) / 2
        aux_mean = (aux_grads[0][index] + aux_grads[1][index]) / 2
        torch.testing.assert_close(ranks[0]["grads"][key] - plain_mean, aux_mean)

    for rank, batch in enumerate(batches):
        # each rank's losses are the reference's on its batch
        torch.testing.assert_close(ranks[rank]["losses"], per_rank[rank][0])
        # kept entries reached the batch given to DDP, with their graph,
        # equal to the extractor called directly (KEEP_KEYS.md invariant 4)
        assert ranks[rank]["kept_has_graph"]
        with torch.no_grad():
            torch.testing.assert_close(
                ranks[rank]["kept"]["critic_features"],
                extractor(batch["observation"]),
            )
            torch.testing.assert_close(
                ranks[rank]["kept"]["next", "critic_features"],
                extractor(batch["next", "observation"]),
            )


# --------------------------------------------------------------------------
# The Ray learner: Trainer(learner_backend="ray"), 2 gloo ranks
# --------------------------------------------------------------------------


class _StateReader:
    """A checkpoint component that only receives the state it is loaded with."""

    def __init__(self) -> None:
        self.state = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        self.state = state


def replay_ray_learner(loss_cls, loss_state, data):
    """What the 2 ranks do, in one process: the mean gradient of 2 chunks a step.

    The buffer samples sequentially, without replacement, and DDP keeps the
    ranks in step, so step ``k`` takes chunks ``2k`` and ``2k + 1`` of the
    storage (which rank got which does not change their mean).
    """
    loss = make_loss(loss_cls)
    loss.load_state_dict(loss_state)
    optimizer = torch.optim.SGD(loss.parameters(), lr=LR)
    aux_values = []
    for step in range(RAY_STEPS):
        grads = []
        for chunk in (2 * step, 2 * step + 1):
            batch = data[chunk * RANK_BATCH : (chunk + 1) * RANK_BATCH]
            losses, chunk_grads = reference_grads(loss, batch)
            grads.append(chunk_grads)
            if "loss_aux" in losses.keys():
                aux_values.append(losses["loss_aux"])
        for name, param in loss.named_parameters():
            param.grad = (grads[0][name] + grads[1][name]) / 2
        optimizer.step()
        optimizer.zero_grad()
    return loss.state_dict(), aux_values


@pytest.mark.slow
def test_ray_learner_trains_the_auxiliary_loss_on_two_ranks(tmp_path, monkeypatch):
    ray = pytest.importorskip(
        "ray",
        reason="Trainer(learner_backend='ray') needs ray: "
        "pip install -r requirements-slow.txt",
    )
    from torchrl.collectors.distributed import RayCollector
    from torchrl.data import RayReplayBuffer

    # nothing leaves the machine: no usage report, and Ray's servers listen on
    # loopback. Ray binds them to the node's address, which on Linux is the
    # routable one (``_node_ip_address="127.0.0.1"`` is resolved back to it)
    # unless Ray treats the node as it does on macOS and Windows: no cluster.
    # The variable covers the processes Ray starts; this process imported ray
    # (through torchrl) before it was set, so its constant is patched too.
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    env_vars = {"PYTHONPATH": str(TEST_DIR)}
    interface = _loopback_interface()
    if interface is not None:
        env_vars["GLOO_SOCKET_IFNAME"] = interface
    ray.init(
        # a new local instance, never an existing cluster
        address="local",
        # logical CPUs: replay buffer, collector and 2 learner ranks
        num_cpus=4,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,
        # Ray's workers import this module (the loss class, make_env)
        runtime_env={"env_vars": env_vars},
    )
    try:
        assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
        torch.manual_seed(SEED)
        loss = make_loss(AuxPPOLoss)
        loss_state = copy.deepcopy(loss.state_dict())
        optimizer = torch.optim.SGD(loss.parameters(), lr=LR)
        total_frames = RAY_FRAMES
        optim_steps = RAY_STEPS
        batch_size = 2 * RANK_BATCH
        replay_buffer = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, RAY_FRAMES),
            sampler=partial(SamplerWithoutReplacement, shuffle=False),
            batch_size=batch_size,
            remote_config={"num_cpus": 1},
            transport="ray",
        )
        collector = RayCollector(
            create_env_fn=[make_env],
            policy=loss.actor_network,
            collector_class=Collector,
            collector_kwargs={"auto_register_policy_transforms": False},
            frames_per_batch=RAY_FRAMES,
            total_frames=RAY_FRAMES,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        logger = MemoryLogger()
        trainer = Trainer(
            collector=collector,
            total_frames=total_frames,
            frame_skip=1,
            optim_steps_per_batch=optim_steps,
            loss_module=loss,
            optimizer=optimizer,
            replay_buffer=replay_buffer,
            batch_size=batch_size,
            learner_backend="ray",
            learner_backend_options={
                "world_size": 2,
                "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                "backend": "gloo",
                # the ranks' rendezvous store listens on loopback
                "store_host": "127.0.0.1",
                "setup_timeout": PROCESS_TIMEOUT,
                "command_timeout": PROCESS_TIMEOUT,
            },
            logger=logger,
            log_interval=0,
            progress_bar=False,
            seed=SEED,
            # the ranks' states, saved when training ends
            checkpoint=Checkpoint(),
            save_trainer_file=tmp_path / "checkpoint",
        )
        collected = []

        def record_batch(batch):
            collected.append(batch.clone())

        trainer.register_op("batch_process", record_batch)
        trainer.train()
        stored = replay_buffer[:]
        replay_buffer.shutdown()
    finally:
        ray.shutdown()

    reader = _StateReader()
    Checkpoint().register("learner_execution", reader).load(
        tmp_path / "checkpoint", components=["learner_execution"]
    )
    rank_states = [rank["loss_module"] for rank in reader.state["backend"]["ranks"]]
    assert len(rank_states) == 2
    # both ranks end with the same parameters (and buffers), bitwise; the
    # value estimator made by the first call adds its own buffers
    assert set(rank_states[0]) == set(rank_states[1]) >= set(loss_state)
    for key in sorted(rank_states[0]):
        assert torch.equal(rank_states[0][key], rank_states[1][key]), key

    # kept entries never reach the replay buffer: it holds what was collected,
    # nothing more and nothing that requires grad. The ranks keep into their
    # own copies of the samples; each step also sends its batch, kept entries
    # included, to the replay actor for a priority update, which this
    # (non-prioritized) sampler ignores
    assert len(collected) == 1
    collected = collected[0].reshape(-1)
    assert set(stored.keys(True, True)) - {"index"} == set(collected.keys(True, True))
    for key in collected.keys(True, True):
        assert torch.equal(stored[key], collected[key]), key
        assert not stored[key].requires_grad, key

    # the ranks trained AuxPPOLoss: they match its replay here...
    aux_state, aux_values = replay_ray_learner(AuxPPOLoss, loss_state, stored)
    plain_state, _ = replay_ray_learner(ClipPPOLoss, loss_state, stored)
    assert set(aux_state) == set(rank_states[0])
    for key in sorted(aux_state):
        torch.testing.assert_close(rank_states[0][key], aux_state[key])
    # ...and not that of plain PPO, within the same (assert_close's) tolerance:
    # the auxiliary term moved the extractor
    for key in (key for key in loss_state if key.startswith(EXTRACTOR_PREFIX)):
        assert not torch.allclose(
            rank_states[0][key], plain_state[key], rtol=1.3e-6, atol=1e-5
        ), key
    # the Trainer logged loss_aux: its mean over the steps and ranks
    assert len(logger.scalars["loss_aux"]) == 1
    torch.testing.assert_close(
        logger.scalars["loss_aux"][0], torch.stack(aux_values).mean()
    )


# --------------------------------------------------------------------------
# The README section
# --------------------------------------------------------------------------


def readme_code_lines(readme: str, heading: str) -> list[str]:
    """Non-empty lines of the ```python blocks in ``heading``'s section."""
    lines = readme.splitlines()
    if heading not in lines:
        pytest.fail(
            f"README.md has no section {heading!r} yet: add it, with code "
            f"blocks copied from {Path(__file__).name}"
        )
    start = lines.index(heading)
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
        len(lines),
    )
    section = "\n".join(lines[start:end])
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert blocks, f"the README section {heading!r} has no ```python block"
    return [line.strip() for block in blocks for line in block.splitlines()]


def test_readme_training_section_comes_from_these_tests():
    code = readme_code_lines(README.read_text(), README_SECTION)
    source = {line.strip() for line in Path(__file__).read_text().splitlines()}
    missing = [line for line in code if line and line not in source]
    assert not missing, (
        f"README.md, {README_SECTION!r}: these code lines are not in "
        f"{Path(__file__).name}, so no test runs them: {missing}"
    )
