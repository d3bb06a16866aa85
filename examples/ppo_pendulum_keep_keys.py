"""PPO on Pendulum that logs and regularises its features with ``keep_keys``.

The actor and the critic each start with a feature extractor (an MLP writing
``"actor_features"`` / ``"critic_features"``) followed by a head. Upstream
TorchRL's losses run these networks on a clone of the minibatch and drop
everything but the entries they need, so inspecting or regularising the
features would take a second forward pass.

With ``loss.set_keys(keep_keys=["actor_features", "critic_features"])`` the
loss writes the features computed by its *own* forward pass into the
minibatch we pass to it, autograd graph included. This example uses them to:

* log, every update, the mean, the standard deviation and the fraction of dead
  units (ReLU units that are zero for every sample of the minibatch) of both
  feature sets;
* add a small L2 penalty on the critic's features, whose gradient flows
  through that same forward pass: ``(loss_sum + aux).backward()``.

The statistics and the episode return are plotted to a PNG at the end.

It needs the ``torchrl 0.14.1+keepkeys`` fork (stock TorchRL rejects the
``keep_keys`` key) and, besides torch and tensordict, only ``tqdm`` and
``matplotlib``. It uses TorchRL's built-in, gym-free ``PendulumEnv``.

Run it with::

    python examples/ppo_pendulum_keep_keys.py --plot stats.png
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import matplotlib

# headless: the plot is only written to a file
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torchrl  # noqa: E402
from tensordict.nn import (  # noqa: E402
    NormalParamExtractor,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn  # noqa: E402
from torchrl.collectors import Collector  # noqa: E402
from torchrl.envs import (  # noqa: E402
    BatchSizeTransform,
    CatTensors,
    Compose,
    PendulumEnv,
    RewardSum,
    StepCounter,
    TransformedEnv,
    UnaryTransform,
)
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal  # noqa: E402
from torchrl.objectives import ClipPPOLoss  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402
from tqdm import tqdm  # noqa: E402

KEPT = ["actor_features", "critic_features"]
# Pendulum never terminates: episodes are truncated after this many steps
MAX_STEPS = 200
# units whose activation stays at or below this on the whole minibatch are dead
DEAD_EPS = 1e-6


def _cos(th):
    return th.cos().unsqueeze(-1)


def _sin(th):
    return th.sin().unsqueeze(-1)


def _unsqueeze(x):
    return x.unsqueeze(-1)


def make_env(num_envs: int, seed: int) -> TransformedEnv:
    """A batch of ``num_envs`` pendulums observing ``[cos th, sin th, thdot]``."""
    env = TransformedEnv(
        PendulumEnv(seed=seed),
        Compose(
            # PendulumEnv is stateless and batch-unlocked: give it a batch
            # size so the collector steps all pendulums at once
            BatchSizeTransform(batch_size=[num_envs]),
            # the raw angle wraps around at +-pi; cos/sin are continuous.
            # Module-level functions (not lambdas) keep the env picklable.
            UnaryTransform(in_keys=["th"], out_keys=["cos_th"], fn=_cos),
            UnaryTransform(in_keys=["th"], out_keys=["sin_th"], fn=_sin),
            UnaryTransform(in_keys=["thdot"], out_keys=["thdot_obs"], fn=_unsqueeze),
            CatTensors(
                in_keys=["cos_th", "sin_th", "thdot_obs"],
                out_key="observation",
                sort=False,
            ),
            StepCounter(max_steps=MAX_STEPS),
            # undiscounted return of each episode, for the progress bar/plot
            RewardSum(),
        ),
    )
    return env


def make_modules(env: TransformedEnv, hidden: int):
    """Actor and critic, each a feature extractor followed by a head."""
    n_obs = env.observation_spec["observation"].shape[-1]
    action_spec = env.full_action_spec_unbatched["action"]
    n_act = action_spec.shape[-1]

    def extractor(out_key):
        # ReLU on the last layer too: these are the features we monitor
        return TensorDictModule(
            MLP(
                in_features=n_obs,
                out_features=hidden,
                num_cells=[hidden],
                activation_class=nn.ReLU,
                activate_last_layer=True,
            ),
            in_keys=["observation"],
            out_keys=[out_key],
        )

    actor = ProbabilisticActor(
        TensorDictSequential(
            extractor("actor_features"),
            TensorDictModule(
                nn.Sequential(nn.Linear(hidden, 2 * n_act), NormalParamExtractor()),
                in_keys=["actor_features"],
                out_keys=["loc", "scale"],
            ),
        ),
        in_keys=["loc", "scale"],
        spec=action_spec,
        distribution_class=TanhNormal,
        # TanhNormal squashes into the torque bounds of the env
        distribution_kwargs={
            "low": action_spec.space.low,
            "high": action_spec.space.high,
        },
        return_log_prob=True,
    )
    critic = TensorDictSequential(
        extractor("critic_features"),
        TensorDictModule(
            nn.Linear(hidden, 1),
            in_keys=["critic_features"],
            out_keys=["state_value"],
        ),
    )
    return actor, critic


def feature_stats(features: torch.Tensor) -> dict[str, float]:
    """Mean, std and dead-unit fraction of a ``[batch, units]`` feature tensor."""
    features = features.detach()
    dead = (features <= DEAD_EPS).all(dim=0).float().mean()
    return {
        "mean": features.mean().item(),
        "std": features.std().item(),
        "dead": dead.item(),
    }


def plot(history: dict[str, list[float]], frames: list[int], path: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    ax = axes[0, 0]
    ax.plot(frames, history["episode_return"], "o-", ms=3)
    ax.set_title("return of episodes completed in the batch")
    panels = [
        (axes[0, 1], "mean", "feature mean"),
        (axes[1, 0], "std", "feature std"),
        (axes[1, 1], "dead", "fraction of dead units"),
    ]
    for ax, stat, title in panels:
        for name in KEPT:
            ax.plot(frames, history[f"{name}/{stat}"], label=name)
        ax.set_title(title + " (from the loss's forward pass)")
        ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("frames")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="total frames")
    parser.add_argument("--frames-per-batch", type=int, default=2_000)
    parser.add_argument(
        "--num-envs",
        type=int,
        default=10,
        help="pendulums stepped in parallel; must divide --frames-per-batch",
    )
    parser.add_argument("--epochs", type=int, default=4, help="PPO epochs per batch")
    parser.add_argument("--minibatch", type=int, default=250, help="minibatch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=64, help="feature width")
    parser.add_argument(
        "--aux-coef",
        type=float,
        default=1e-3,
        help="weight of the L2 penalty on the kept critic features",
    )
    parser.add_argument("--plot", default="keep_keys_stats.png", help="PNG path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.frames_per_batch % args.num_envs:
        parser.error("--num-envs must divide --frames-per-batch")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    # the networks are tiny: extra intra-op threads only add synchronisation
    # cost (milliseconds per matmul when the cores are busy)
    torch.set_num_threads(1)
    start = time.perf_counter()

    env = make_env(args.num_envs, args.seed)
    actor, critic = make_modules(env, args.hidden)

    loss = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=0.2,
        entropy_coeff=1e-3,
        critic_coeff=0.5,
        normalize_advantage=True,
    )
    try:
        loss.set_keys(keep_keys=KEPT)
    except (TypeError, ValueError):
        # stock TorchRL has no such key
        print(
            "this example needs a torchrl with keep_keys support "
            f"(torchrl 0.14.1+keepkeys); found torchrl {torchrl.__version__}",
            file=sys.stderr,
        )
        return 1
    # the advantage is computed once per batch, before the epochs, so the
    # loss only runs the actor and the critic on the current step
    gae = GAE(gamma=0.9, lmbda=0.95, value_network=critic, average_gae=False)
    optim = torch.optim.Adam(loss.parameters(), lr=args.lr)

    collector = Collector(
        env,
        actor,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames,
        # the actor is stateless (no recurrent cell): opt out of the automatic
        # InitTracker registration that torchrl 0.15 will make the default
        auto_register_policy_transforms=False,
    )

    history = {"episode_return": []}
    for name in KEPT:
        for stat in ("mean", "std", "dead"):
            history[f"{name}/{stat}"] = []
    frames = []
    collected = 0
    last_return = float("nan")
    pbar = tqdm(total=args.frames, unit="frames")
    for data in collector:
        collected += data.numel()
        # completed episodes: the step where an episode got truncated
        done = data["next", "done"]
        if done.any():
            last_return = data["next", "episode_reward"][done].mean().item()
            history["episode_return"].append(last_return)
        else:
            history["episode_return"].append(float("nan"))

        with torch.no_grad():
            gae(data)
        # The collector's policy call already wrote (detached) actor features
        # into the batch: drop them so that every feature read below comes from
        # the loss's own forward pass.
        data = data.exclude(*KEPT).reshape(-1)

        batch_stats = {key: [] for key in history if key != "episode_return"}
        for _ in range(args.epochs):
            for idx in torch.randperm(data.numel()).split(args.minibatch):
                minibatch = data[idx]
                losses = loss(minibatch)
                # written by the loss into `minibatch`, with their graph
                actor_features = minibatch["actor_features"]
                critic_features = minibatch["critic_features"]
                # they are the tensors of the loss's own pass, not detached copies
                assert critic_features.grad_fn is not None
                for name, features in zip(KEPT, (actor_features, critic_features)):
                    for stat, value in feature_stats(features).items():
                        batch_stats[f"{name}/{stat}"].append(value)

                loss_sum = sum(v for k, v in losses.items() if k.startswith("loss_"))
                # auxiliary loss on the kept features: backpropagates through
                # the critic pass the loss already did, no second forward
                aux = args.aux_coef * critic_features.pow(2).mean()
                optim.zero_grad()
                (loss_sum + aux).backward()
                nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
                optim.step()

        for key, values in batch_stats.items():
            history[key].append(sum(values) / len(values))
        frames.append(collected)
        # the collector shares the actor's parameters: nothing to copy, but
        # this is where a multi-process collector would get the new weights
        collector.update_policy_weights_()
        pbar.update(data.numel())
        pbar.set_postfix(
            ret=f"{last_return:.0f}",
            dead_critic=f"{history['critic_features/dead'][-1]:.2f}",
        )
    pbar.close()
    collector.shutdown()

    plot(history, frames, args.plot)
    elapsed = time.perf_counter() - start
    final = [r for r in history["episode_return"] if not math.isnan(r)]
    print(
        f"{collected} frames in {elapsed:.1f}s; "
        f"last episode return: {final[-1] if final else float('nan'):.1f}; "
        f"plot: {args.plot}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
