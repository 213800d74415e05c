"""``quotientgeo bench sharpness``: seconds per Auto-PGD iteration against one forward+backward.

The model is a ``layers``-layer transformer classifier
(:class:`~quotientgeo.testing.TinyTransformerClassifier`, width ``d``, ``heads`` heads,
feed-forward width ``4d``) on one batch of ``batch × seq`` random inputs. Contenders, timed by
:func:`.timing.interleaved`:

- ``floor``: one forward pass and ``loss.backward()``;
- for adaptive sharpness, geodesic sharpness (mix, inv; second-order map) and exact geodesic
  sharpness (inv, closed-form geodesic): a run with ``n_iter`` and a run with
  ``n_iter + extra`` iterations. Per round, seconds per iteration are
  ``(long - short) / extra``: setup, the base-point factorizations and the last forward pass
  cancel. So do Auto-PGD's checkpoints where both runs have as many (by default 16 and 24
  iterations, seven each): a run has at most eight whatever its length (at fractions of
  ``n_iter``), and a restart there costs one more forward pass, a per-run cost that a window
  between runs of 2 and 10 iterations (one checkpoint and four) would spread over its
  iterations as if every iteration paid it.

Ratios (``geodesic_mix/adaptive``, ``geodesic_inv/adaptive``, ``adaptive/floor``,
``exact_inv/second_order_inv``) are medians over rounds of the per-round ratios; seconds are
medians over rounds. An iteration can cost more than one evaluation of the loss: a restart from
an earlier best point evaluates its gradient again, and the first-order move of the worst
point costs one forward pass. ``evaluations_per_iteration`` counts the calls of ``loss_fn`` per
extra iteration, and ``ratios_per_evaluation`` divides each ratio by the ratio of those
counts. Peak memory is measured by ``quotientgeo bench memory`` (:mod:`.memory`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from ..sharpness import Measure
from ..testing import TinyTransformerClassifier, cross_entropy
from .options import add_model_arguments, run_config, window_checkpoints
from .timing import interleaved, median_ratio

RHO = 0.05
MEASURES = {
    "adaptive": Measure.adaptive(RHO),
    "geodesic_mix": Measure.geodesic(RHO, metric="mix", perturbation="second_order"),
    "geodesic_inv": Measure.geodesic(RHO, metric="inv", perturbation="second_order"),
    "geodesic_inv_exact": Measure.geodesic(RHO, metric="inv", perturbation="exact"),
}
RATIOS = {
    "geodesic_mix/adaptive": ("geodesic_mix", "adaptive"),
    "geodesic_inv/adaptive": ("geodesic_inv", "adaptive"),
    "adaptive/floor": ("adaptive", "floor"),
    "exact_inv/second_order_inv": ("geodesic_inv_exact", "geodesic_inv"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, layers=4, d=256, heads=8, seq=64, batch=32, rounds=6)
    parser.add_argument("--n-iter", type=int, default=16, help="iterations of the short run")
    parser.add_argument("--extra", type=int, default=8, help="extra iterations of the long run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="progress bar over rounds")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the measures with compile=True (the adaptive rest's Gram pass compiled)",
    )


def run(args: argparse.Namespace) -> int:
    """Time adaptive and geodesic sharpness per Auto-PGD iteration against forward+backward."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = TinyTransformerClassifier(
        args.d, args.heads, args.layers, classes=10, dim_feedforward=4 * args.d
    )
    model = model.to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    batch = (
        torch.randn(args.batch, args.seq, args.d, generator=gen).to(device),
        torch.randint(0, 10, (args.batch,), generator=gen).to(device),
    )

    def floor():
        cross_entropy(model, batch).backward()
        model.zero_grad(set_to_none=True)

    evaluations: dict[str, int] = {}

    def measure(name: str, n_iter: int):
        m = MEASURES[name].replace(n_iter=n_iter)
        key = f"{name}@{n_iter}"

        def counted(model, batch):
            evaluations[key] = evaluations.get(key, 0) + 1
            return cross_entropy(model, batch)

        def run():
            evaluations[key] = 0
            m.evaluate(model, counted, [batch], progress=False, compile=args.compile)

        return run

    short, long = args.n_iter, args.n_iter + args.extra
    contenders: dict[str, Callable[[], object]] = {"floor": floor}
    for name in MEASURES:
        contenders[f"{name}@{short}"] = measure(name, short)
        contenders[f"{name}@{long}"] = measure(name, long)
    samples = interleaved(contenders, rounds=args.rounds, device=device, progress=args.progress)
    per_iteration = {"floor": samples["floor"]}
    for name in MEASURES:
        per_iteration[name] = [
            (b - a) / args.extra
            for a, b in zip(samples[f"{name}@{short}"], samples[f"{name}@{long}"], strict=True)
        ]
    out: dict[str, object] = {f"{k}_s": statistics.median(v) for k, v in per_iteration.items()}
    out["ratios"] = {
        key: median_ratio(per_iteration[a], per_iteration[b]) for key, (a, b) in RATIOS.items()
    }
    # forward passes of loss_fn per iteration: 1, plus the restarts' evaluations at the best
    # point and the first-order move's forward, spread over the extra iterations
    per_evaluation = {"floor": 1.0}
    for name in MEASURES:
        per_evaluation[name] = (evaluations[f"{name}@{long}"] - evaluations[f"{name}@{short}"]) / (
            args.extra
        )
    out["evaluations_per_iteration"] = {k: v for k, v in per_evaluation.items() if k != "floor"}
    out["checkpoints"] = window_checkpoints(short, long)
    out["ratios_per_evaluation"] = {
        key: out["ratios"][key] * per_evaluation[b] / per_evaluation[a]
        for key, (a, b) in RATIOS.items()
    }
    out["config"] = run_config(
        args, "layers", "d", "heads", "seq", "batch", "n_iter", "extra", "rounds", "compile"
    )
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"floor (forward+backward): {out['floor_s']:.4f} s")
    for name in MEASURES:
        print(f"{name:>18}: {out[f'{name}_s']:.4f} s/iteration")
    for key, value in out["ratios"].items():
        print(f"{key:>27}: {value:.3f}")
    for name, value in out["evaluations_per_iteration"].items():
        print(f"{name:>18}: {value:.2f} evaluations/iteration")
    for key, value in out["ratios_per_evaluation"].items():
        print(f"{key:>27}: {value:.3f} per evaluation")
    return 0
