"""PPO on Pendulum, trained twice: with and without an auxiliary loss on kept features.

The critic is a feature extractor followed by a linear head. The extractor is
two TensorDictModules: an MLP writing the pre-activation ``"critic_preact"``
and a ReLU writing ``"critic_features"``. Upstream TorchRL's losses run the
critic on a clone of the minibatch and drop everything but the value, so
logging or regularising these entries would take a second forward pass of the
extractor.

With ``loss.set_keys(keep_keys=["critic_preact", "critic_features"])`` the loss
writes both entries, computed by its *own* critic call, into the minibatch we
pass to it, autograd graph included. This example uses them twice:

* **Logging, for free.** Every update logs the mean, the standard deviation
  and the fraction of dead units of ``"critic_features"``: ReLU units that are
  zero on every sample of the minibatch. In plain PPO more than half of them
  (61% in the default run) die within the first few batches and stay dead.
* **An auxiliary loss, without a second pass.** A second run, with the same
  seed, networks, hyper-parameters and number of frames, adds a dead-unit
  revival penalty on ``"critic_preact"``: for each unit, the largest
  pre-activation over the minibatch is pushed above a small margin,
  ``relu(margin - preact.max(0)).mean()``. Its gradient flows through the
  critic pass the loss already did: ``(loss_sum + aux_coef * aux).backward()``.

Why the pre-activation: a dead unit's ReLU outputs zero and its derivative is
zero, so *no* loss written on the post-ReLU features (an L2 or variance
penalty, the critic loss itself) sends any gradient to the weights feeding it,
and the unit can never come back. The penalty on the pre-activation reaches
those weights directly: for a unit whose largest pre-activation is below the
margin, it raises that pre-activation (the unit's bias and its input weights
along that sample) until the unit fires on part of the data again, and from
then on the unit is zero in the penalty and the critic loss trains it as
usual. Units that fire above the margin on some sample of the minibatch are not
touched at all, which is why the dead fraction drops to about zero while the
return stays comparable (one seed: read the return curves as "no harm done",
not as a benchmark).

The same run then times one update (loss, auxiliary loss, backward, optimizer
step; one thread) with ``keep_keys`` against the workaround: ``keep_keys`` off
and the extractor run a second time to get the pre-activations, the same
auxiliary loss. Both variants start from the same weights and get the same
minibatches, interleaved (alternating which goes first); the first update's
gradients are checked to be equal, and the medians and their ratio are
reported.

One PNG shows the two runs side by side (returns, dead fraction, feature mean
and std) and the time per update; a JSON summary is written next to it. Both go
to ``--out DIR`` or ``--plot PATH``, or to a fresh temporary directory.

It needs the ``torchrl 0.14.1+keepkeys`` fork (stock TorchRL rejects the
``keep_keys`` key) and, besides torch and tensordict, only ``tqdm`` and
``matplotlib``. It uses TorchRL's built-in, gym-free ``PendulumEnv``.

Run it with::

    python examples/ppo_pendulum_keep_keys.py --out results/
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

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

KEPT = ["critic_preact", "critic_features"]
# Pendulum never terminates: episodes are truncated after this many steps
MAX_STEPS = 200
# units whose activation stays at or below this on the whole minibatch are dead
DEAD_EPS = 1e-6
# the revival penalty pushes each unit's largest pre-activation above this
REVIVE_MARGIN = 0.1
RUNS = {
    "baseline": "baseline: PPO",
    "aux": "aux: PPO + revival penalty on the kept pre-activations",
}
STATS = ("mean", "std", "dead")


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
    """Actor and critic; the critic's extractor writes its pre-activation and its features."""
    n_obs = env.observation_spec["observation"].shape[-1]
    action_spec = env.full_action_spec_unbatched["action"]
    n_act = action_spec.shape[-1]

    actor = ProbabilisticActor(
        TensorDictSequential(
            TensorDictModule(
                MLP(
                    in_features=n_obs,
                    out_features=hidden,
                    num_cells=[hidden],
                    activation_class=nn.ReLU,
                    activate_last_layer=True,
                ),
                in_keys=["observation"],
                out_keys=["actor_features"],
            ),
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
        # the extractor, split in two so that its pre-activation can be kept
        TensorDictModule(
            MLP(
                in_features=n_obs,
                out_features=hidden,
                num_cells=[hidden],
                activation_class=nn.ReLU,
            ),
            in_keys=["observation"],
            out_keys=["critic_preact"],
        ),
        TensorDictModule(
            nn.ReLU(), in_keys=["critic_preact"], out_keys=["critic_features"]
        ),
        # the head
        TensorDictModule(
            nn.Linear(hidden, 1),
            in_keys=["critic_features"],
            out_keys=["state_value"],
        ),
    )
    return actor, critic


def has_keep_keys() -> bool:
    """Whether the installed torchrl's losses accept ``keep_keys``."""
    try:
        make_loss(*make_modules(make_env(1, 0), 2), keep=True)
    except (TypeError, ValueError):
        # stock TorchRL has no such key
        return False
    return True


def make_loss(actor, critic, keep: bool) -> ClipPPOLoss:
    loss = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=0.2,
        entropy_coeff=1e-3,
        critic_coeff=0.5,
        normalize_advantage=True,
    )
    if keep:
        loss.set_keys(keep_keys=KEPT)
    return loss


def revival_penalty(preact: torch.Tensor) -> torch.Tensor:
    """Push every unit's largest pre-activation over the minibatch above the margin.

    Zero (and no gradient) for units that fire on at least one sample by more
    than the margin; for the others it raises the pre-activation of the sample
    closest to firing. It must see the pre-activation: on the post-ReLU
    features, dead units have no gradient.
    """
    return torch.relu(REVIVE_MARGIN - preact.max(dim=0).values).mean()


def feature_stats(features: torch.Tensor) -> dict[str, float]:
    """Mean, std and dead-unit fraction of a ``[batch, units]`` feature tensor."""
    features = features.detach()
    dead = (features <= DEAD_EPS).all(dim=0).float().mean()
    return {
        "mean": features.mean().item(),
        "std": features.std().item(),
        "dead": dead.item(),
    }


def ppo_losses(loss: ClipPPOLoss, minibatch) -> torch.Tensor:
    losses = loss(minibatch)
    return sum(v for k, v in losses.items() if k.startswith("loss_"))


def train(args: argparse.Namespace, aux_coef: float, desc: str):
    """One PPO run; returns its per-batch history, modules and last batch."""
    # same seed for both runs: same initial weights, same environment seeds
    torch.manual_seed(args.seed)
    env = make_env(args.num_envs, args.seed)
    actor, critic = make_modules(env, args.hidden)
    loss = make_loss(actor, critic, keep=True)
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

    history = {"frames": [], "episode_return": [], "aux": []}
    history.update({stat: [] for stat in STATS})
    collected = 0
    last_return = float("nan")
    pbar = tqdm(total=args.frames, unit="frames", desc=desc)
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
        # the collector's policy call wrote (detached) actor features: they
        # are not needed, drop them
        data = data.exclude("actor_features").reshape(-1)

        batch_stats = {key: [] for key in (*STATS, "aux")}
        for _ in range(args.epochs):
            for idx in torch.randperm(data.numel()).split(args.minibatch):
                minibatch = data[idx]
                loss_sum = ppo_losses(loss, minibatch)
                # written by the loss into `minibatch`, from its own critic
                # call and with its graph: not detached copies
                preact = minibatch["critic_preact"]
                features = minibatch["critic_features"]
                assert preact.grad_fn is not None
                for stat, value in feature_stats(features).items():
                    batch_stats[stat].append(value)
                # the auxiliary loss backpropagates through the critic pass
                # the loss already did: no second forward
                aux = revival_penalty(preact)
                batch_stats["aux"].append(aux.item())
                if aux_coef:
                    loss_sum = loss_sum + aux_coef * aux
                optim.zero_grad()
                loss_sum.backward()
                nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
                optim.step()
                # `minibatch` now holds the kept entries and, through them,
                # the whole graph of this update. It is dropped at the next
                # iteration; to keep minibatches across iterations (a replay
                # buffer, a list for later), store `minibatch.exclude(*KEPT)`
                # or `minibatch.detach()`, or every graph stays in memory.

        for key, values in batch_stats.items():
            history[key].append(sum(values) / len(values))
        history["frames"].append(collected)
        # the collector shares the actor's parameters: nothing to copy, but
        # this is where a multi-process collector would get the new weights
        collector.update_policy_weights_()
        pbar.update(data.numel())
        pbar.set_postfix(ret=f"{last_return:.0f}", dead=f"{history['dead'][-1]:.2f}")
    pbar.close()
    collector.shutdown()
    return history, actor, critic, data


def time_updates(args, actor, critic, data) -> dict:
    """Time one update with keep_keys against a second extractor pass, interleaved."""
    variants = {}
    for name, keep in (("keep_keys", True), ("second_pass", False)):
        # each variant trains its own copy, from the same weights
        v_actor, v_critic = copy.deepcopy(actor), copy.deepcopy(critic)
        loss = make_loss(v_actor, v_critic, keep=keep)
        optim = torch.optim.Adam(loss.parameters(), lr=args.lr)
        variants[name] = (loss, optim, v_critic[0])

    def backward(name, idx):
        loss, optim, extractor = variants[name]
        minibatch = data[idx]
        loss_sum = ppo_losses(loss, minibatch)
        if name == "keep_keys":
            preact = minibatch["critic_preact"]
        else:
            # the workaround: run the extractor again to get the pre-activations
            preact = extractor(minibatch.select("observation"))["critic_preact"]
        optim.zero_grad()
        (loss_sum + args.aux_coef * revival_penalty(preact)).backward()

    def update(name, idx):
        loss, optim, _ = variants[name]
        backward(name, idx)
        nn.utils.clip_grad_norm_(loss.parameters(), 1.0)
        optim.step()

    # minibatch indices, not minibatches: a minibatch holding kept entries
    # holds their graph (see train())
    n_warmup = 5
    indices = [
        torch.randint(data.numel(), (args.minibatch,))
        for _ in range(n_warmup + args.timed_updates)
    ]

    # same weights, same minibatch: both variants compute the same gradients
    grads = {}
    for name, (loss, optim, _) in variants.items():
        # the entropy of a TanhNormal is estimated by sampling: same draws
        torch.manual_seed(args.seed)
        backward(name, indices[0])
        grads[name] = [p.grad.clone() for p in loss.parameters() if p.grad is not None]
        optim.zero_grad()
    same_grads = len(grads["keep_keys"]) == len(grads["second_pass"]) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads["keep_keys"], grads["second_pass"])
    )

    times = {name: [] for name in variants}
    for i, idx in enumerate(indices):
        # alternate which variant goes first
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name in order:
            start = time.perf_counter()
            update(name, idx)
            elapsed = time.perf_counter() - start
            if i >= n_warmup:
                times[name].append(elapsed * 1e3)
    kk = statistics.median(times["keep_keys"])
    sp = statistics.median(times["second_pass"])
    return {
        "updates": args.timed_updates,
        "minibatch": args.minibatch,
        "threads": torch.get_num_threads(),
        "same_gradients": same_grads,
        "keep_keys_ms_median": kk,
        "second_pass_ms_median": sp,
        "ratio_second_pass_over_keep_keys": sp / kk,
        "keep_keys_ms": times["keep_keys"],
        "second_pass_ms": times["second_pass"],
    }


def final(values: list[float], n: int = 3) -> float | None:
    """Mean of the last ``n`` non-NaN values (None if there are none)."""
    values = [v for v in values if not math.isnan(v)][-n:]
    return sum(values) / len(values) if values else None


def plot(histories: dict, timing: dict, path: Path) -> None:
    """Returns, dead fraction, feature mean/std of both runs; time per update."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    colors = {"baseline": "tab:blue", "aux": "tab:orange"}

    ax = axes[0, 0]
    for run, h in histories.items():
        ax.plot(
            h["frames"],
            h["episode_return"],
            "o-",
            ms=3,
            color=colors[run],
            label=RUNS[run],
        )
    ax.set_title("episode return (mean over the episodes completed in each batch)")
    ax.set_ylabel("return")

    ax = axes[0, 1]
    for run, h in histories.items():
        ax.plot(h["frames"], h["dead"], color=colors[run], label=RUNS[run])
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("fraction of dead critic units (zero on the whole minibatch)")
    ax.set_ylabel("dead fraction")

    ax = axes[1, 0]
    for run, h in histories.items():
        ax.plot(h["frames"], h["mean"], color=colors[run], label=f"{run}: mean")
        ax.plot(h["frames"], h["std"], "--", color=colors[run], label=f"{run}: std")
    ax.set_ylim(bottom=0)
    ax.set_title("critic features: mean (solid) and std (dashed)")
    ax.set_ylabel("feature value")

    for ax in (axes[0, 0], axes[0, 1], axes[1, 0]):
        ax.set_xlabel("frames")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    axes[0, 1].legend(fontsize=8, loc="center right")
    axes[1, 0].legend(fontsize=8, loc="lower left", ncol=2)

    ax = axes[1, 1]
    labels = [
        "keep_keys\n(kept pre-activations)",
        "keep_keys off\n+ second extractor pass",
    ]
    data = [timing["keep_keys_ms"], timing["second_pass_ms"]]
    ax.boxplot(data, showfliers=False)
    ax.set_xticks([1, 2], labels)
    for x, values in enumerate(data, start=1):
        med = statistics.median(values)
        ax.annotate(
            f"median {med:.2f} ms",
            (x, med),
            xytext=(40, -4),
            textcoords="offset points",
            fontsize=9,
        )
    ax.set_ylabel("ms per update")
    ax.set_title(
        "time per update: PPO loss + aux loss + backward + Adam step\n"
        f"{timing['updates']} interleaved updates each, {timing['threads']} thread; "
        "ratio of medians\n(second pass / keep_keys): "
        f"{timing['ratio_second_pass_over_keep_keys']:.3f}"
    )
    ax.grid(alpha=0.3, axis="y")

    frames = histories["baseline"]["frames"][-1]
    fig.suptitle(
        f"PPO on Pendulum, {frames} frames per run, same seed: "
        "without and with an auxiliary loss on the kept critic pre-activations"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="frames per run")
    parser.add_argument("--frames-per-batch", type=int, default=4_000)
    parser.add_argument(
        "--num-envs",
        type=int,
        default=20,
        help="pendulums stepped in parallel; must divide --frames-per-batch",
    )
    parser.add_argument("--epochs", type=int, default=4, help="PPO epochs per batch")
    parser.add_argument("--minibatch", type=int, default=500, help="minibatch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=64, help="feature width")
    parser.add_argument(
        "--aux-coef",
        type=float,
        default=1.0,
        help="weight of the revival penalty on the kept pre-activations (aux run)",
    )
    parser.add_argument(
        "--timed-updates",
        type=int,
        default=200,
        help="updates timed per variant (keep_keys, second pass)",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument(
        "--out", type=Path, help="directory for the PNG and the JSON summary"
    )
    out.add_argument(
        "--plot", type=Path, help="PNG path; the JSON summary goes next to it"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.frames_per_batch % args.num_envs:
        parser.error("--num-envs must divide --frames-per-batch")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # the networks are tiny: extra intra-op threads only add synchronisation
    # cost (milliseconds per matmul when the cores are busy)
    torch.set_num_threads(1)
    start = time.perf_counter()

    if not has_keep_keys():
        print(
            "this example needs a torchrl with keep_keys support "
            f"(torchrl 0.14.1+keepkeys); found torchrl {torchrl.__version__}",
            file=sys.stderr,
        )
        return 1

    # never write into the repository or the cwd unless asked to
    if args.plot is not None:
        png = args.plot
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="ppo_keep_keys_"))
        png = out / "ppo_pendulum_keep_keys.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    png = png.resolve()
    summary_path = png.with_suffix(".json")

    histories = {}
    histories["baseline"], *_ = train(args, aux_coef=0.0, desc="baseline")
    histories["aux"], actor, critic, data = train(
        args, aux_coef=args.aux_coef, desc="aux"
    )
    timing = time_updates(args, actor, critic, data)

    plot(histories, timing, png)
    summary = {
        "torchrl": torchrl.__version__,
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
        "runs": {
            run: {
                "description": RUNS[run],
                "aux_coef": 0.0 if run == "baseline" else args.aux_coef,
                "frames": h["frames"][-1],
                "final_return": final(h["episode_return"]),
                "final_dead_fraction": h["dead"][-1],
                "final_feature_mean": h["mean"][-1],
                "final_feature_std": h["std"][-1],
                # no episode ended in a batch: NaN in the plot, null here
                "history": {
                    k: [None if math.isnan(x) else x for x in v] for k, v in h.items()
                },
            }
            for run, h in histories.items()
        },
        "timing": {k: v for k, v in timing.items() if not k.endswith("_ms")},
        "png": str(png),
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    elapsed = time.perf_counter() - start
    for run in histories:
        r = summary["runs"][run]
        ret = r["final_return"]
        print(
            f"{run:>8}: {r['frames']} frames, final return "
            f"{'n/a' if ret is None else f'{ret:.1f}'}, "
            f"dead critic units {r['final_dead_fraction']:.2f}"
        )
    print(
        f"time per update: keep_keys {timing['keep_keys_ms_median']:.2f} ms, "
        f"second pass {timing['second_pass_ms_median']:.2f} ms, ratio "
        f"{timing['ratio_second_pass_over_keep_keys']:.3f} "
        f"(same gradients: {timing['same_gradients']})"
    )
    print(f"done in {elapsed:.1f}s\nplot: {png}\nsummary: {summary_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
