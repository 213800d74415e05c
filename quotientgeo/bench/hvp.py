r"""``quotientgeo bench cost --hvp``: what one Hessian-vector product of the Riemannian Hessian
(:class:`~quotientgeo.curvature.RiemannianHessian`) costs, in forward+backward passes of the
same model.

On the decoder of ``bench cost`` (:func:`.memory.build`) at each depth, for each ``product``
(``"double_backward"``, ``"finite_difference"``) of the Riemannian operator
(``symmetries="auto"``, ``geometry="riemannian"``), the operator is built (uncounted: its
gradient at the weights is paid once, whatever the number of products) and one product
``H @ z`` at a random whitened ``z`` is counted with :class:`~.cost.CostCounter`. Reported per
product:

- ``ops``, ``host_reads``, ``copies`` (bytes in parameter copies) of the whole product;
- ``fb_ops`` and ``fb_bytes``: the same operators and bytes divided by those of one forward
  pass and ``loss.backward()`` (the floor): the product's cost in forward+backward passes;
- ``evaluations`` and ``backward``: the calls of ``loss_fn`` and the backward passes through
  their losses (the second backward of double backward runs through the gradient's graph, not
  the loss: it shows in ``fb_ops``, not here);
- ``beyond_ops``, ``beyond_host_reads``, ``beyond_copies``: the product's counts less those
  evaluations and backward passes at the floor's counts (the geometry's own work:
  whitening, projections, the connection term, the functional call's scatter).

With ``--hvp-rounds N`` the wall time of one product is also taken (the benchmarks' timing
harness, :func:`.timing.interleaved`, ``N`` rounds), against one forward+backward and, when
curvlinops is importable, against its ``HessianLinearOperator`` on the same model and batch
(the plain Euclidean Hessian of the same loss: compare it with ``euclidean``, our operator
with ``geometry="euclidean"``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from .memory import build, parameter_bytes
from .timing import interleaved, median_ratio, medians

PRODUCTS = ("double_backward", "finite_difference")


def _probe(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(dim, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def _costs(model, loss_fn, batch) -> dict[str, dict[str, float]]:
    """The counts of one product of each kind (module docstring), and the floor's."""
    from ..curvature import RiemannianHessian
    from .cost import _combine, _Evaluations, count

    def forward_backward():
        loss_fn(model, batch).backward()

    def forward_grad():
        loss_fn(model, batch)

    fb = count(forward_backward)
    model.zero_grad(set_to_none=True)
    fwd = count(forward_grad)
    bwd = _combine((1, fb), (-1, fwd))
    copy = parameter_bytes(model)
    rows: dict[str, dict[str, float]] = {"floor": dict(_combine((1, fb)))}
    for product in PRODUCTS:
        evals = _Evaluations(loss_fn)
        H = RiemannianHessian(model, evals, [batch], product=product)
        z = _probe(H.dim, H.dtype, H.device)
        evals.grad = evals.no_grad = evals.backward = 0
        total = count(lambda H=H, z=z: H @ z)
        model_cost = _combine((evals.grad, fwd), (evals.backward, bwd))
        rows[product] = {
            "ops": total["ops"],
            "host_reads": total["host_reads"],
            "bytes": total["bytes"],
            "fb_ops": total["ops"] / fb["ops"],
            "fb_bytes": total["bytes"] / fb["bytes"],
            "evaluations": evals.grad + evals.no_grad,
            "backward": evals.backward,
            "beyond_ops": total["ops"] - model_cost["ops"],
            "beyond_host_reads": total["host_reads"] - model_cost["host_reads"],
            "beyond_copies": (total["bytes"] - model_cost["bytes"]) / copy,
        }
        del H, z
    for row in rows.values():
        row["copies"] = row.pop("bytes") / copy
    return rows


def _curvlinops(model, batch):
    """curvlinops' ``HessianLinearOperator`` of the same language-modelling loss (the mean
    cross-entropy of the next token), or ``None`` where curvlinops is not importable."""
    try:
        from curvlinops import HessianLinearOperator  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            logits = self.model(input_ids=ids).logits[:, :-1]
            return logits.reshape(-1, logits.shape[-1])

    params = [p for p in model.parameters() if p.requires_grad]
    return HessianLinearOperator(
        Logits(model),
        torch.nn.CrossEntropyLoss(),
        params,
        [(batch, batch[:, 1:].reshape(-1))],
        progressbar=False,
        check_deterministic=False,
    )


def _times(model, loss_fn, batch, rounds: int) -> dict[str, Any]:
    """Median seconds of one product of each contender and their ratios to one
    forward+backward (module docstring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..curvature import RiemannianHessian

    def forward_backward():
        loss_fn(model, batch).backward()
        model.zero_grad(set_to_none=True)

    contenders: dict[str, Any] = {"forward_backward": forward_backward}
    for name, product, geometry in (
        ("double_backward", "double_backward", "riemannian"),
        ("finite_difference", "finite_difference", "riemannian"),
        ("euclidean", "double_backward", "euclidean"),
    ):
        H = RiemannianHessian(model, loss_fn, [batch], product=product, geometry=geometry)
        z = _probe(H.dim, H.dtype, H.device)
        contenders[name] = lambda H=H, z=z: H @ z
    theirs = _curvlinops(model, batch)
    if theirs is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        v = _probe(sum(p.numel() for p in params), params[0].dtype, params[0].device)

        def curvlinops_product():
            with sdpa_kernel(SDPBackend.MATH):  # as ours: a kernel with second derivatives
                return theirs @ v

        contenders["curvlinops"] = curvlinops_product
    samples = interleaved(contenders, rounds=rounds)
    seconds = medians(samples)
    return {
        "seconds": seconds,
        "per_forward_backward": {
            name: median_ratio(times, samples["forward_backward"])
            for name, times in samples.items()
        },
        "rounds": rounds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Per depth: the counts of one product, and its times with ``args.hvp_rounds > 0``."""
    out: dict[str, Any] = {}
    for layers in args.layers:
        ns = argparse.Namespace(**{**vars(args), "layers": layers})
        model, loss_fn, batch = build(ns)
        out[str(layers)] = {"parameter_bytes": parameter_bytes(model)}
        out[str(layers)]["per_product"] = _costs(model, loss_fn, batch)
        if args.hvp_rounds > 0:
            out[str(layers)]["times"] = _times(model, loss_fn, batch, args.hvp_rounds)
    return out


def show(depths: dict[str, Any]) -> None:
    """The counts (and times) as a table per depth."""
    for layers, depth in depths.items():
        print(f"{layers} layers, one Riemannian Hessian-vector product:")
        print(f"{'':>18} | {'ops':>7} {'host reads':>10} {'copies':>7} | forward+backward passes")
        for name, r in depth["per_product"].items():
            fb = "" if name == "floor" else (
                f"ops {r['fb_ops']:.2f}, bytes {r['fb_bytes']:.2f} "
                f"({r['evaluations']} evaluations, {r['backward']} backward; beyond them "
                f"{r['beyond_ops']:.0f} ops, {r['beyond_host_reads']:.0f} host reads, "
                f"{r['beyond_copies']:.1f} copies)"
            )  # fmt: skip
            print(f"{name:>18} | {r['ops']:7.0f} {r['host_reads']:10.0f} {r['copies']:7.1f} | {fb}")
        if "times" in depth:
            t = depth["times"]
            print(f"  wall time, median of {t['rounds']} rounds:")
            for name, s in t["seconds"].items():
                ratio = t["per_forward_backward"][name]
                print(f"{name:>18} | {s:8.3f} s  {ratio:6.2f} × forward+backward")
