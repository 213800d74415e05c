r"""``quotientgeo bench cost``: what one iteration of a measure, or one optimizer step, costs
beyond the model's own forward and backward passes, counted at the dispatcher.

:class:`CostCounter` is a ``TorchDispatchMode``: every ATen operator that reaches the dispatcher
under it is seen once, whatever the device, so the same command gives the same counts on the
CPU and on CUDA. It counts

- **operators**: the non-view ATen calls (a view, ``func.is_view``, launches no kernel; nor does
  ``_unsafe_view``, a view that autograd does not track, counted as one), a proxy for kernel
  launches;
- **host reads**: the calls that make the host wait for a tensor's value, each one a device
  synchronisation on an accelerator: ``_local_scalar_dense`` (``item()``, ``bool()``,
  ``float()``, ``int()`` of a tensor), ``is_nonzero``, ``equal``, ``nonzero`` and the other
  operators whose output size depends on the values (``masked_select``, ``unique``, indexing
  with a boolean mask), the linear algebra that checks its result on the host
  (``_linalg_check_errors``, ``_linalg_eigh``), and any blocking copy from a device to the
  CPU (a ``non_blocking`` one does not make the host wait: the read of its value afterwards is
  the one counted). Reads of a tensor's memory that bypass the dispatcher (``tolist()`` of a
  CPU tensor, ``numpy()``) are not seen;
- **bytes**: the bytes of the tensor inputs plus the tensor outputs of every counted
  operator, a proxy for memory traffic (an in-place operator counts the tensor it writes as an
  input and as an output, once, whether or not it returns it). An allocation (``empty``,
  ``empty_strided``, ``new_empty``, ...) is an operator that touches no memory: its output is
  not counted.

The command builds the GPT-2-style decoder of ``bench memory`` (:func:`.memory.build`, a small
width, 12 heads by default) at two depths and reports, per depth:

- ``floor``: one forward pass and ``loss.backward()`` (operators, host reads, bytes);
- for every measure (``adaptive``, ``geodesic_mix``, ``geodesic_inv``, ``geodesic_inv_exact``,
  ``average``) the cost **per iteration** (per sample for ``average``) beyond the model: a run
  of ``n_iter`` and one of ``n_iter + extra`` iterations are counted, from each the calls of
  ``loss_fn`` (with and without gradient) and the backward passes are subtracted at the
  counts of the floor's forward and backward passes, and the difference of the two runs is
  divided by ``extra`` (setup, the base point's copy and the restoration cancel, and so do
  Auto-PGD's checkpoints: runs of 16 and 26 iterations by default have seven each, see
  :mod:`.sharpness`);
- for ``sam``, ``asam``, ``geodesic_sam`` (:class:`~quotientgeo.GeodesicSAM` around
  ``torch.optim.SGD``) the cost per step beyond two forward+backward passes and the base
  optimizer's step, and for ``quotient_optimizer`` (geoopt's ``RiemannianSGD``) beyond one
  forward+backward; ``sgd`` is the plain step, for scale. Optimizer steps are counted after one
  uncounted step (lazy state).

Bytes are reported in parameter copies: divided by the bytes of the trainable parameters in
their own dtype.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .memory import build, measures, parameter_bytes
from .options import run_config, window_checkpoints

aten = torch.ops.aten

#: Operators that make the host wait for a tensor's values (a device synchronisation).
HOST_READS = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.is_nonzero.default,
        aten.equal.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._linalg_check_errors.default,
        aten._linalg_eigh.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
    }
)


#: Operators that alias their input like a view, though their schema does not say so: counted
#: as views (no operator, no bytes).
ALIASES = frozenset({aten._unsafe_view.default})

#: Operators that allocate their output without writing it: operators, but no bytes.
ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments that ``func`` writes (in-place and ``out=`` operators; the
    ``_foreach_*_`` ones return nothing)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            out += _tensors(value)
    return out


def _is_host_read(func, args, kwargs, out) -> bool:
    if func in HOST_READS:
        return True
    if func is aten.index.Tensor:  # indexing with a boolean mask (its size is data dependent)
        return any(t.dtype == torch.bool for t in _tensors(args[1]))
    if _non_blocking(func, args, kwargs):  # the host waits later, where it reads the value
        return False
    inputs, outputs = _tensors((args, kwargs)), _tensors(out)
    return any(t.device.type != "cpu" for t in inputs) and any(
        t.device.type == "cpu" for t in outputs
    )


def _non_blocking(func, args, kwargs) -> bool:
    """Whether a copy was asked not to block (``non_blocking=True``)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "non_blocking":
            return bool(kwargs.get(arg.name, args[i] if i < len(args) else False))
    return False


class CostCounter(TorchDispatchMode):
    """Counts non-view ATen operators, host reads and bytes touched while active (module
    docstring); ``with CostCounter() as c: ...`` then ``c.ops``, ``c.host_reads``,
    ``c.bytes``. ``paused`` stops counting without leaving the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0
        self.bytes = 0
        self.paused = False
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or func.is_view or func in ALIASES:
            return out
        self.ops += 1
        name = str(func.overloadpacket.__name__)
        self.by_op[name] = self.by_op.get(name, 0) + 1
        if _is_host_read(func, args, kwargs, out):
            self.host_reads += 1
        if func in ALLOCATIONS:
            return out
        written = {id(t): t for t in [*_tensors(out), *_mutated(func, args, kwargs)]}
        self.bytes += sum(t.nbytes for t in _tensors((args, kwargs)))
        self.bytes += sum(t.nbytes for t in written.values())
        return out

    def totals(self) -> dict[str, int]:
        return {"ops": self.ops, "host_reads": self.host_reads, "bytes": self.bytes}


def count(fn: Callable[[], object]) -> dict[str, int]:
    """``{"ops", "host_reads", "bytes"}`` of one call of ``fn``."""
    with CostCounter() as counter:
        fn()
    return counter.totals()


def _combine(*terms: tuple[float, Mapping[str, float]]) -> dict[str, float]:
    """``Σ wᵢ · countsᵢ`` key by key."""
    keys = ("ops", "host_reads", "bytes")
    return {k: sum(w * c[k] for w, c in terms) for k in keys}


class _Evaluations:
    """``loss_fn`` wrapped to count its calls with and without gradient and the backward
    passes through its losses."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.grad = self.no_grad = self.backward = 0

    def __call__(self, model, batch):
        loss = self.loss_fn(model, batch)
        if loss.requires_grad:
            self.grad += 1
            loss.register_hook(self._backward)
        else:
            self.no_grad += 1
        return loss

    def _backward(self, grad):
        self.backward += 1


def _depth(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """The counts of every contender on the decoder of ``layers`` layers."""
    ns = argparse.Namespace(**{**vars(args), "layers": layers})
    model, loss_fn, batch = build(ns)
    copy = parameter_bytes(model)

    def forward_backward():
        loss_fn(model, batch).backward()

    def forward_no_grad():
        with torch.no_grad():
            loss_fn(model, batch)

    def forward_grad():
        loss_fn(model, batch)

    fb = count(forward_backward)
    model.zero_grad(set_to_none=True)
    fwd = count(forward_grad)
    fwd0 = count(forward_no_grad)
    bwd = _combine((1, fb), (-1, fwd))
    rows: dict[str, dict[str, float]] = {"floor": _combine((1, fb))}

    def measure_overhead(name: str, n: int) -> tuple[dict[str, float], float]:
        m = measures(n, n)[name]
        evals = _Evaluations(loss_fn)
        total = count(
            lambda: m.evaluate(model, evals, [batch], progress=False, compile=args.compile)
        )
        model_cost = _combine((evals.grad, fwd), (evals.no_grad, fwd0), (evals.backward, bwd))
        over = {k: total[k] - model_cost[k] for k in total}
        return over, evals.grad + evals.no_grad

    short, long = args.n_iter, args.n_iter + args.extra
    for name in measures(1, 1):
        a, ea = measure_overhead(name, short)
        b, eb = measure_overhead(name, long)
        rows[name] = {k: (b[k] - a[k]) / args.extra for k in a}
        rows[name]["evaluations"] = (eb - ea) / args.extra
    rows.update(_optimizers(model, loss_fn, batch, fb, args.steps, args.compile))
    for row in rows.values():
        row["copies"] = row.pop("bytes") / copy
    return {"parameter_bytes": copy, "per_iteration": rows}


def _optimizers(
    model, loss_fn, batch, fb, steps: int, compile: bool
) -> dict[str, dict[str, float]]:
    """Per step of SGD, SAM, ASAM, geodesic SAM (``compile``: with ``compile=True``) and the
    quotient optimizer, beyond the model's passes (and, for the SAM variants, beyond SGD's
    step)."""
    import geoopt

    from ..optim import GeodesicSAM, quotient_optimizer

    state = {n: p.detach().clone() for n, p in model.named_parameters()}

    def closure():
        loss = loss_fn(model, batch)
        loss.backward()
        return loss

    def per_step(opt, passes: int) -> dict[str, float]:
        def step():
            opt.zero_grad()
            if isinstance(opt, GeodesicSAM):
                opt.step(closure)
            else:
                closure()
                opt.step()

        step()  # lazy state
        total = count(lambda: [step() for _ in range(steps)])
        with torch.no_grad():  # the next optimizer starts from the same weights
            for n, p in model.named_parameters():
                p.copy_(state[n])
        return _combine((1 / steps, total), (-passes, fb))

    out = {"sgd": per_step(torch.optim.SGD(model.parameters(), lr=1e-4), 1)}
    for name, variant in (("sam", "sam"), ("asam", "asam"), ("geodesic_sam", "geodesic")):
        opt = GeodesicSAM(
            model, torch.optim.SGD, rho=0.05, variant=variant, lr=1e-4, compile=compile
        )
        out[name] = _combine((1, per_step(opt, 2)), (-1, out["sgd"]))
    opt = quotient_optimizer(model, geoopt.optim.RiemannianSGD, lr=1e-4)
    out["quotient_optimizer"] = per_step(opt, 1)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[4, 12], help="the depths to count"
    )
    parser.add_argument("--d", "--width", dest="d", type=int, default=192, help="model width")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--n-iter", type=int, default=16, help="iterations of the short run")
    parser.add_argument("--extra", type=int, default=10, help="extra iterations of the long run")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps counted")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the measures and the SAM variants with compile=True (the rest's passes by "
        "compiled kernels, each counted as one operator with the bytes it reads and writes)",
    )
    parser.add_argument(
        "--hvp",
        action="store_true",
        help="count one Hessian-vector product of the Riemannian Hessian instead of the "
        "measures (quotientgeo.bench.hvp)",
    )
    parser.add_argument(
        "--hvp-rounds", type=int, default=0, help="with --hvp: also time it over this many rounds"
    )


#: The options a run's JSON records.
CONFIG = ("layers", "d", "heads", "vocab", "seq", "batch", "dtype", "n_iter", "extra", "compile")


def run(args: argparse.Namespace) -> int:
    """Operators, host reads and bytes per iteration of every measure, beyond the model."""
    torch.manual_seed(0)
    if args.hvp:
        return _run_hvp(args)
    out: dict[str, Any] = {
        "depths": {str(layers): _depth(args, layers) for layers in args.layers},
        "checkpoints": window_checkpoints(args.n_iter, args.n_iter + args.extra),
        "config": run_config(args, *CONFIG),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    depths = list(out["depths"])
    names = list(out["depths"][depths[0]]["per_iteration"])
    head = " | ".join(f"{layers} layers: ops / host reads / copies" for layers in depths)
    print(f"{'':>20} | {head}")
    for name in names:
        cells = []
        for layers in depths:
            r = out["depths"][layers]["per_iteration"][name]
            cells.append(f"{r['ops']:8.0f} / {r['host_reads']:5.1f} / {r['copies']:7.1f}")
        print(f"{name:>20} | " + " | ".join(f"{c:>34}" for c in cells))
    return 0


def _run_hvp(args: argparse.Namespace) -> int:
    """``--hvp``: the cost of one Hessian-vector product (:mod:`.hvp`)."""
    from . import hvp

    out = {
        "depths": hvp.run(args),
        "config": run_config(
            args, "layers", "d", "heads", "vocab", "seq", "batch", "dtype", "hvp_rounds"
        ),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        hvp.show(out["depths"])
    return 0
