"""``quotientgeo bench generic``: closed forms against the generic (autodiff) base class.

For ``GLQuotient`` (inv and mix) at the paper's size (144 heads, ``n = m = 769``, ``h = 64``,
float32): ``proju`` with a fresh and with a cached point, and ``christoffel`` through
``m.generic()`` (conjugate gradients for ``M⁻¹``) and ``m.generic(metric_inv=True)`` (the
closed-form ``M⁻¹``). Reports seconds, the generic/closed ratio and the relative difference.
All timings come from :func:`quotientgeo.bench.timing.interleaved`.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from quotientgeo.bench.timing import interleaved, median_ratio, medians
from quotientgeo.manifolds import GLQuotient

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=144, help="batch of heads (default 144)")
    parser.add_argument("--n", type=int, default=769, help="rows of G (default 769)")
    parser.add_argument("--m", type=int, default=769, help="rows of H (default 769)")
    parser.add_argument("--h", type=int, default=64, help="head width h (default 64)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--metrics", nargs="+", choices=["inv", "mix"], default=["inv", "mix"])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _time_metric(m: GLQuotient, x, u, rounds: int, device: torch.device) -> list[dict]:
    """Rows (op, variant, closed/generic seconds, ratio, relative difference) for one metric."""
    g, g_inv = m.generic(), m.generic(metric_inv=True)
    px, pg = m.at(x), g.at(x)
    cases = {
        ("proju", "fresh x"): (lambda: m.proju(x, u), lambda: g.proju(x, u)),
        ("proju", "cached m.at(x)"): (lambda: m.proju(px, u), lambda: g.proju(pg, u)),
        ("christoffel", "fresh x"): (lambda: m.christoffel(x, u), lambda: g.christoffel(x, u)),
        ("christoffel", "closed metric_inv"): (
            lambda: m.christoffel(x, u),
            lambda: g_inv.christoffel(x, u),
        ),
    }
    contenders = {}
    for key, (closed_fn, generic_fn) in cases.items():
        contenders[(*key, "closed")] = closed_fn
        contenders[(*key, "generic")] = generic_fn
    samples = interleaved(contenders, rounds=rounds, device=device)  # warm-up fills the caches
    seconds = medians(samples)
    rows = []
    for (op, variant), (closed_fn, generic_fn) in cases.items():
        closed, generic = (op, variant, "closed"), (op, variant, "generic")
        rows.append(
            {
                "metric": m.metric_name,
                "op": op,
                "variant": variant,
                "closed_s": seconds[closed],
                "generic_s": seconds[generic],
                "ratio": median_ratio(samples[generic], samples[closed]),
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
        rows += _time_metric(m, x, u, args.rounds, device)
    result = {
        "benchmark": "generic",
        "config": {
            "heads": args.heads,
            "n": args.n,
            "m": args.m,
            "h": args.h,
            "dtype": args.dtype,
            "device": str(device),
            "rounds": args.rounds,
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
        f"median of {cfg['rounds']} interleaved rounds"
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
