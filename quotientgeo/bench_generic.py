"""``quotientgeo bench generic``: closed-form vs generic (autodiff) geometry of ``GLQuotient``.

Times ``proju`` and ``christoffel`` of :class:`GLQuotient` (both metrics) against the same
methods computed by the generic base (``m.generic()``), at one size (default: 144 heads,
``n = m = 769``, ``h = 64``, float32), with a fresh point and with a cached point ``m.at(x)``.
Reports the median seconds over repeats after one warm-up call, and the ratio generic/closed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from .manifolds import GLQuotient
from .manifolds.base import GenericPath

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class _GenericWithMetricInv(GenericPath):
    """Generic path, but with the subclass's closed-form ``metric_inv`` (no CG for ``M⁻¹``)."""

    def __getattr__(self, name: str):
        if name == "metric_inv":
            return getattr(self._manifold, name)
        return super().__getattr__(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=144, help="batch of heads (default 144)")
    parser.add_argument("--n", type=int, default=769, help="rows of G (default 769)")
    parser.add_argument("--m", type=int, default=769, help="rows of H (default 769)")
    parser.add_argument("--h", type=int, default=64, help="head width h (default 64)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--metrics", nargs="+", choices=["inv", "mix"], default=["inv", "mix"])
    parser.add_argument("--repeat", type=int, default=3, help="timed calls after a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _median_seconds(fn, repeat: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _time_metric(m: GLQuotient, x, u, repeat: int, device: torch.device) -> list[dict]:
    """Rows (op, variant, closed/generic seconds, ratio, relative difference) for one metric."""
    g, g_inv = m.generic(), _GenericWithMetricInv(m)
    px, pg = m.at(x), g.at(x)
    m.proju(px, u), g.proju(pg, u)  # fill the caches (excluded from the cached timings)
    cases = {
        "proju": [
            ("fresh x", lambda: m.proju(x, u), lambda: g.proju(x, u)),
            ("cached m.at(x)", lambda: m.proju(px, u), lambda: g.proju(pg, u)),
        ],
        "christoffel": [
            ("fresh x", lambda: m.christoffel(x, u), lambda: g.christoffel(x, u)),
            ("closed metric_inv", lambda: m.christoffel(x, u), lambda: g_inv.christoffel(x, u)),
        ],
    }
    rows = []
    for op, variants in cases.items():
        for variant, closed_fn, generic_fn in variants:
            closed = _median_seconds(closed_fn, repeat, device)
            generic = _median_seconds(generic_fn, repeat, device)
            rows.append(
                {
                    "metric": m.metric_name,
                    "op": op,
                    "variant": variant,
                    "closed_s": closed,
                    "generic_s": generic,
                    "ratio": generic / closed,
                    "rel_err": _rel_err(generic_fn(), closed_fn()),
                }
            )
    return rows


def run(args: argparse.Namespace) -> int:
    """Time closed-form vs generic (autodiff) proju and christoffel on GLQuotient."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.heads, args.n + args.m, args.h)
    rows = []
    for metric in args.metrics:
        m = GLQuotient(args.n, metric)
        x = torch.randn(shape, generator=gen, dtype=dtype, device=device) / args.h**0.5
        u = torch.randn(shape, generator=gen, dtype=dtype, device=device)
        rows += _time_metric(m, x, u, args.repeat, device)
    result = {
        "benchmark": "generic",
        "config": {
            "heads": args.heads,
            "n": args.n,
            "m": args.m,
            "h": args.h,
            "dtype": args.dtype,
            "device": str(device),
            "repeat": args.repeat,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "max_ratio": max(r["ratio"] for r in rows),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    cfg = result["config"]
    print(
        f"GLQuotient generic vs closed form: {cfg['heads']} heads, n={cfg['n']}, m={cfg['m']}, "
        f"h={cfg['h']}, {cfg['dtype']} on {cfg['device']} ({cfg['threads']} threads), "
        f"median of {cfg['repeat']}"
    )
    header = f"{'metric':6} {'op':11} {'variant':18} {'closed s':>10} {'generic s':>10} "
    print(header + f"{'ratio':>8} {'rel err':>9}")
    for r in rows:
        print(
            f"{r['metric']:6} {r['op']:11} {r['variant']:18} {r['closed_s']:10.4f} "
            f"{r['generic_s']:10.4f} {r['ratio']:7.1f}x {r['rel_err']:9.1e}"
        )
    print(f"max ratio generic/closed: {result['max_ratio']:.1f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=run.__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
