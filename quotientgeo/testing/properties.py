r"""The properties of the quotient contract, and how each one's relative error is measured.

``PROPERTIES`` names them in the order :func:`~quotientgeo.testing.check_quotient` checks them;
a ``ContractRun`` holds the point and the random draws of one call and measures each property
(raising ``Skipped``, with the reason, where the manifold lacks what the property needs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..manifolds.base import QuotientManifold
from ..manifolds.quotient import GenericPath

Tensor = torch.Tensor

__all__ = ["PROPERTIES", "ContractRun", "Skipped"]

#: Every property :func:`check_quotient` knows, in the order it checks them.
PROPERTIES = (
    "metric_inv",
    "isotropic",
    "proju_horizontal",
    "proju_vertical",
    "proju_idempotent",
    "random_tangent",
    "egrad2rgrad",
    "action_affine",
    "metric_invariance",
    "proju_equivariance",
    "egrad2rgrad_equivariance",
    "christoffel_equivariance",
    "expmap2_equivariance",
    "expmap_equivariance",
    "generic.inner",
    "generic.metric_inv",
    "generic.proju",
    "generic.egrad2rgrad",
    "generic.christoffel",
    "generic.christoffel_uv",
    "generic.expmap2",
    "generic.expmap",
)

_TINY = torch.finfo(torch.float64).tiny


class Skipped(Exception):
    """A property that cannot be checked on this manifold (the message says why)."""


class ContractRun:
    """The state of one :func:`check_quotient` call: the point, the draws, the checks."""

    def __init__(self, m: QuotientManifold, x: Tensor, generator, group, radius, linear_rtol):
        self.m, self.x, self.generator, self.group, self.radius = m, x, generator, group, radius
        self.linear_rtol = linear_rtol
        self._generic: QuotientManifold | None = None
        self.p = m.at(x)
        self.batch = x.shape[: x.dim() - m.ndim]
        self.lie = tuple(m.lie_shape(self.p))
        self.k = math.prod(self.lie)
        self._action: str | None = None  # why the action cannot be checked, once known

    # ------------------------------------------------------------------ draws
    def randn(self, *shape: int) -> Tensor:
        return torch.randn(
            shape, generator=self.generator, dtype=self.x.dtype, device=self.x.device
        )

    def draw(self) -> None:
        m, p = self.m, self.p
        self.e1, self.e2, self.grad = (self.randn(*self.x.shape) for _ in range(3))
        self.u, self.v = m.isotropic(p, self.e1), m.isotropic(p, self.e2)
        self.omega = self.randn(*self.batch, *self.lie)
        self.w = self.u
        if self.radius is not None:
            self.w = self.radius * self.u / m.norm(p, self.u, keepdim=True)
        self.g = None
        self.cache: dict[str, Any] = {}

    def element(self) -> Any:
        """The group element of this round (``Skipped`` without an action)."""
        if self._action is not None:
            raise Skipped(self._action)
        if self.g is None:
            try:
                g = self.group
                if g is None:
                    g = self.m.random_group(self.x, generator=self.generator)
                self.gx = self.m.act(self.x, g)
            except NotImplementedError as err:
                self._action = str(err)
                raise Skipped(self._action) from None
            self.g = g
        return self.g

    def push(self, u: Tensor) -> Tensor:
        g = self.element()
        try:
            return self.m.push(self.x, u, g)
        except NotImplementedError:
            shape = torch.broadcast_shapes(self.x.shape, u.shape)
            x, u = self.x.expand(shape).contiguous(), u.expand(shape).contiguous()
            return torch.func.jvp(lambda y: self.m.act(y, g), (x,), (u,))[1]

    def nontrivial(self) -> None:
        if self.k == 0:
            raise Skipped("the group is trivial (a Lie algebra of dimension 0)")

    # ------------------------------------------------------------------ errors
    def scalar(self, a: Tensor, b: Tensor, scale: Tensor) -> float:
        d = (a.double() - b.double()).abs() / scale.double().clamp_min(_TINY)
        return float(d.max()) if d.numel() else 0.0

    def vector(self, y: Tensor, a: Tensor, b: Tensor, scale: Tensor | None = None) -> float:
        """``max(‖a - b‖_y / ‖s‖_y, ‖a - b‖₂ / ‖s‖₂)`` in float64, ``s = b`` unless given."""
        m = self.m
        y64, d = y.double(), a.double() - b.double()
        s = (b if scale is None else scale).double()
        d, s = (t.expand(torch.broadcast_shapes(t.shape, y64.shape)) for t in (d, s))
        metric = m.norm(y64, d) / m.norm(y64, s).clamp_min(_TINY)
        dims = tuple(range(-m.ndim, 0))
        euclid = torch.linalg.vector_norm(d, dim=dims) / torch.linalg.vector_norm(
            s, dim=dims
        ).clamp_min(_TINY)
        err = torch.maximum(metric, euclid)
        if bool(torch.isnan(err).any()):
            return math.nan
        return float(err.max()) if err.numel() else 0.0

    # ------------------------------------------------------------------ properties
    def checks(self, *, generic: bool, generic_expmap: bool) -> dict[str, Callable[[], float]]:
        """Property name → the function that measures its relative error (every property)."""
        checks: dict[str, Callable[[], float]] = {
            "metric_inv": self.metric_inv,
            "isotropic": self.isotropic,
            "proju_horizontal": self.proju_horizontal,
            "proju_vertical": self.proju_vertical,
            "proju_idempotent": self.proju_idempotent,
            "random_tangent": self.random_tangent,
            "egrad2rgrad": self.egrad2rgrad,
            "action_affine": self.action_affine,
            "metric_invariance": self.metric_invariance,
            "proju_equivariance": self.proju_equivariance,
            "egrad2rgrad_equivariance": self.egrad2rgrad_equivariance,
            "christoffel_equivariance": self.christoffel_equivariance,
            "expmap2_equivariance": lambda: self.exp_equivariance("expmap2"),
            "expmap_equivariance": lambda: self.exp_equivariance("expmap"),
        }
        for name in PROPERTIES:
            if name.startswith("generic."):
                method = name.removeprefix("generic.")
                checks[name] = self.against_generic(method, generic, generic_expmap)
        return checks

    def metric_inv(self) -> float:
        m, p = self.m, self.p
        return self.vector(self.x, m.metric(p, m.metric_inv(p, self.u)), self.u)

    def isotropic(self) -> float:
        m = self.m
        value = m.inner(self.p, self.u, self.v)
        exact = m._reduce(self.e1 * self.e2, keepdim=False)
        norms = m._reduce(self.e1.square(), False) * m._reduce(self.e2.square(), False)
        return self.scalar(value, exact, norms.sqrt())

    def proju_horizontal(self) -> float:
        m, p = self.m, self.p
        self.nontrivial()
        vert = m.vertical(p, self.omega)
        value = m.inner(p, m.proju(p, self.u), vert)
        return self.scalar(value, torch.zeros_like(value), m.norm(p, self.u) * m.norm(p, vert))

    def proju_vertical(self) -> float:
        m, p = self.m, self.p
        self.nontrivial()
        vert = m.vertical(p, self.omega)
        return self.vector(self.x, m.proju(p, vert), torch.zeros_like(vert), vert)

    def proju_idempotent(self) -> float:
        m, p = self.m, self.p
        self.nontrivial()
        pu = m.proju(p, self.u)
        return self.vector(self.x, m.proju(p, pu), pu, self.u)

    def random_tangent(self) -> float:
        m, p = self.m, self.p
        r = m.random_tangent(p, generator=self.generator)
        return self.vector(self.x, m.proju(p, r), r)

    def egrad2rgrad(self) -> float:
        m, p = self.m, self.p
        rho = m.egrad2rgrad(p, self.grad)
        horizontal = self.vector(self.x, m.proju(p, rho), rho)
        h = m.proju(p, self.v)
        value = m.inner(p, rho, h)
        exact = m._reduce(self.grad * h, keepdim=False)
        pairing = self.scalar(value, exact, m.norm(p, rho) * m.norm(p, h))
        return max(horizontal, pairing)

    def action_affine(self) -> float:
        if "linear" not in self.cache:
            g = self.element()
            moved = self.m.act(self.x + self.u, g)
            self.cache["linear"] = self.vector(self.gx, moved - self.gx, self.push(self.u))
        error = self.cache["linear"]
        if not error <= self.linear_rtol:
            raise Skipped(
                f"the action is not affine in x (relative error {error:.2e}): the "
                "Christoffel and expmap2 equivariances do not apply"
            )
        return error

    def linear(self) -> None:
        """Skip unless the action is affine (the properties that assume it)."""
        try:
            self.action_affine()
        except Skipped:
            raise Skipped("the action is not affine in x") from None

    def metric_invariance(self) -> float:
        m, p = self.m, self.p
        self.element()
        value = m.inner(self.gx, self.push(self.u), self.push(self.v))
        return self.scalar(value, m.inner(p, self.u, self.v), m.norm(p, self.u) * m.norm(p, self.v))

    def proju_equivariance(self) -> float:
        m = self.m
        self.nontrivial()
        self.element()
        acted = m.proju(self.gx, self.push(self.u))
        return self.vector(self.gx, acted, self.push(m.proju(self.p, self.u)))

    def egrad2rgrad_equivariance(self) -> float:
        m, p = self.m, self.p
        self.element()
        gy = m.at(self.gx)
        moved_grad = m.metric(gy, self.push(m.metric_inv(p, self.grad)))
        acted = m.egrad2rgrad(gy, moved_grad)
        return self.vector(self.gx, acted, self.push(m.egrad2rgrad(p, self.grad)))

    def christoffel_equivariance(self) -> float:
        m = self.m
        self.element()
        self.linear()
        acted = m.christoffel(self.gx, self.push(self.u), self.push(self.v))
        return self.vector(self.gx, acted, self.push(m.christoffel(self.p, self.u, self.v)))

    def exp_equivariance(self, method: str) -> float:
        g = self.element()
        if method == "expmap2":
            self.linear()
        f = getattr(self.m, method)
        acted = f(self.gx, self.push(self.w)) - self.gx
        expected = self.m.act(f(self.p, self.w), g) - self.gx
        return self.vector(self.gx, acted, expected)

    def against_generic(
        self, method: str, generic: bool, generic_expmap: bool
    ) -> Callable[[], float]:
        """The comparison of ``method`` with the generic path's (``generic.<method>``)."""
        m, x, p = self.m, self.x, self.p

        def compare() -> float:
            if not generic:
                raise Skipped("generic=False")
            if isinstance(m, GenericPath):
                raise Skipped("the manifold is the generic path itself")
            if method == "expmap" and not generic_expmap:
                raise Skipped("generic_expmap=False (RK4 through autodiff Christoffel symbols)")
            if self._generic is None:
                self._generic = m.generic()
            gm = self._generic
            if method == "inner":
                scale = m.norm(p, self.u) * m.norm(p, self.v)
                return self.scalar(gm.inner(x, self.u, self.v), m.inner(p, self.u, self.v), scale)
            if method == "metric_inv":
                gp = gm.at(x)
                return self.vector(x, gm.metric_inv(gp, self.u), m.metric_inv(p, self.u))
            if method == "christoffel_uv":
                return self.vector(
                    x, gm.christoffel(x, self.w, self.v), m.christoffel(p, self.w, self.v)
                )
            a, b = getattr(gm, method)(x, self.w), getattr(m, method)(p, self.w)
            if method.startswith("expmap"):
                a, b = a - x, b - x
            return self.vector(x, a, b)

        return compare
