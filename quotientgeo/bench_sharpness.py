"""Seconds per Auto-PGD iteration of adaptive and geodesic sharpness against one forward+backward.

The model is a ``layers``-layer ``nn.TransformerEncoder`` (width ``d``, ``heads`` heads,
feed-forward width ``4d``) with a linear classifier on the mean token, on a batch of
``batch × seq`` random inputs. ``floor_s`` is the fastest of a few plain forward +
``loss.backward()`` passes; a measure's time per iteration is the difference of the wall times
of runs with ``n_iter`` and ``n_iter + extra`` iterations divided by ``extra`` (setup, the
base-point factorizations and the last forward pass cancel), ``*_total_s`` the longer run's
wall time divided by its iteration count. Runs are repeated ``repeats`` times, interleaved
across measures, and the fastest time of each is kept, which filters out interference from
other processes on a shared machine. ``*_cpu_s`` are the same quantities in process CPU time
(``time.process_time``), which load from other processes barely inflates; with one thread they
are the compute cost itself.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from .sharpness import adaptive_sharpness, geodesic_sharpness


class _Classifier(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, classes: int = 10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def _loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256, help="model width")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-iter", type=int, default=2, help="iterations of the short run")
    parser.add_argument("--extra", type=int, default=8, help="extra iterations of the long run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats (min kept)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> tuple[float, float]:
    """``(wall seconds, process CPU seconds)`` of ``fn()``."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def _floor(model, batch, device) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    out = _timed(lambda: _loss(model, batch).backward(), device)
    model.zero_grad(set_to_none=True)
    return out


def _wall(measure, model, batch, device, n_iter: int, **kw) -> tuple[float, float]:
    return _timed(
        lambda: measure(model, _loss, [batch], rho=0.05, n_iter=n_iter, progress=False, **kw),
        device,
    )


def run(args: argparse.Namespace) -> int:
    """Time adaptive and geodesic sharpness per Auto-PGD iteration against forward+backward."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = _Classifier(args.d, args.heads, args.layers).to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    batch = (
        torch.randn(args.batch, args.seq, args.d, generator=gen).to(device),
        torch.randint(0, 10, (args.batch,), generator=gen).to(device),
    )
    runs = {
        "adaptive": (adaptive_sharpness, {}),
        "geodesic_mix": (geodesic_sharpness, {"metric": "mix"}),
        "geodesic_inv": (geodesic_sharpness, {"metric": "inv"}),
    }
    for measure, kw in runs.values():  # warm-up
        _wall(measure, model, batch, device, 1, **kw)
    short, long = args.n_iter, args.n_iter + args.extra
    walls = {name: {short: [], long: []} for name in runs}
    floors = [_floor(model, batch, device) for _ in range(3)]
    names = list(runs)
    for r in range(args.repeats):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate the order between repeats
            measure, kw = runs[name]
            for n in (short, long):
                walls[name][n].append(_wall(measure, model, batch, device, n, **kw))
        floors += [_floor(model, batch, device) for _ in range(3)]
    out: dict[str, object] = {}
    for clock, suffix in ((0, "_s"), (1, "_cpu_s")):
        floor = min(f[clock] for f in floors)
        out[f"floor{suffix}"] = floor
        for name in runs:
            best = {n: min(w[clock] for w in walls[name][n]) for n in (short, long)}
            out[f"{name}{suffix}"] = (best[long] - best[short]) / args.extra
            if clock == 0:
                out[f"{name}_total_s"] = best[long] / long
    floor = out["floor_s"]
    out["ratios"] = {
        "geodesic_mix/adaptive": out["geodesic_mix_s"] / out["adaptive_s"],
        "geodesic_inv/adaptive": out["geodesic_inv_s"] / out["adaptive_s"],
        "adaptive/floor": out["adaptive_s"] / floor,
        "cpu geodesic_mix/adaptive": out["geodesic_mix_cpu_s"] / out["adaptive_cpu_s"],
        "cpu geodesic_inv/adaptive": out["geodesic_inv_cpu_s"] / out["adaptive_cpu_s"],
        "cpu adaptive/floor": out["adaptive_cpu_s"] / out["floor_cpu_s"],
    }
    out["config"] = {
        "layers": args.layers,
        "d": args.d,
        "heads": args.heads,
        "seq": args.seq,
        "batch": args.batch,
        "n_iter": args.n_iter,
        "extra": args.extra,
        "repeats": args.repeats,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"floor (forward+backward): {floor:.4f} s")
        for name in runs:
            print(
                f"{name:>13}: {out[f'{name}_s']:.4f} s/iteration "
                f"(whole run {out[f'{name}_total_s']:.4f} s/iteration)"
            )
        for key, value in out["ratios"].items():
            print(f"{key:>22}: {value:.3f}")
    return 0
