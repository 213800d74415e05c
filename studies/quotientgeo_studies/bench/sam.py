"""``quotientgeo bench sam``: seconds per training step of AdamW, SAM, ASAM and geodesic SAM.

Every method steps the same AdamW on a ``layers``-layer transformer classifier
(:class:`~quotientgeo.testing.TinyTransformerClassifier`, width ``d``, ``heads`` heads) with
one batch of ``batch × seq`` random inputs; a SAM-type step is two forward and backward passes
plus :class:`~quotientgeo.optim.GeodesicSAM`'s two steps. Contenders are timed by
:func:`quotientgeo.bench.timing.interleaved` (``steps`` training steps per contender and
round); ratios to SAM are medians of the per-round ratios.

The steps (:data:`~quotientgeo.optim.training.METHODS`, ``make_optimizer``,
``train_step``) are those ``quotientgeo reproduce sam`` trains with, from
:mod:`quotientgeo.optim.training`.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from quotientgeo.bench.options import add_model_arguments, run_config
from quotientgeo.bench.timing import interleaved, median_ratio
from quotientgeo.optim.training import METHODS, make_optimizer, train_step
from quotientgeo.testing import TinyTransformerClassifier


def step_times(build, x, y, rho: dict[str, float], *, rounds: int, steps: int = 5, **adamw):
    """``(seconds per step, ratio to SAM)`` of every method, from models ``build()`` (each
    method its own, same seed) stepping on ``(x, y)``."""
    contenders = {}
    for method in METHODS:
        torch.manual_seed(0)
        model = build().train()
        opt = make_optimizer(method, model, rho.get(method), **adamw)
        contenders[method] = lambda m=method, mod=model, o=opt: [
            train_step(m, mod, o, x, y) for _ in range(steps)
        ]
    samples = interleaved(contenders, rounds=rounds, device=x.device)
    seconds = {m: statistics.median(v) / steps for m, v in samples.items()}
    ratios = {m: median_ratio(samples[m], samples["sam"]) for m in METHODS}
    return seconds, ratios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, layers=2, d=32, heads=4, seq=16, batch=64, rounds=20)
    parser.add_argument("--rho", type=float, default=0.05, help="ρ of every SAM variant")
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")


def run(args: argparse.Namespace) -> int:
    """Seconds per training step of every method and their ratios to SAM."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.d, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)

    def build():
        model = TinyTransformerClassifier(args.d, args.heads, args.layers, classes=10)
        return model.to(device)

    rho = {m: args.rho for m in METHODS if METHODS[m] is not None}
    seconds, ratios = step_times(
        build, x, y, rho, rounds=args.rounds, steps=args.steps, lr=1e-3, weight_decay=0.05
    )
    out = {
        "seconds_per_step": seconds,
        "over_sam": ratios,
        "config": run_config(
            args, "layers", "d", "heads", "seq", "batch", "rho", "steps", "rounds"
        ),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"training step, {args.layers} layers, d={args.d}, {args.heads} heads, batch "
        f"{args.batch}×{args.seq}, {device}, {out['config']['threads']} threads"
    )
    for m in METHODS:
        print(f"{m:>13}: {seconds[m] * 1e3:8.2f} ms/step  {ratios[m]:.3f} × SAM")
    return 0
