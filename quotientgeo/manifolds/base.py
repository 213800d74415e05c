r"""Generic quotient manifold :math:`\mathcal M / \mathcal G` from a group action and a metric.

A subclass supplies three primitives, each batched over leading dimensions:

- ``lie_shape(x)``: the shape of a Lie-algebra element ``omega`` (dimension ``k = prod``);
- ``vertical(x, omega)``: the infinitesimal action, a linear map ``omega ↦ V_x omega`` from
  the Lie algebra to tangent vectors at ``x`` (its image is the vertical space);
- ``metric(x, u)``: the metric as a linear operator ``u ↦ M(x) u``;

and optionally ``metric_inv(x, v)`` (otherwise conjugate gradients on ``metric``),
``precondition(x, r)`` (an approximate inverse of ``V* M V`` for the iterative projection) and
the finite action ``act(x, g)`` / ``push(x, u, g)``. Everything else is derived:

- inner product ``<u, v>_x = Σ u ⊙ M(x) v`` over the point's trailing ``ndim`` dimensions;
- horizontal projection ``proj(u) = u - V ω`` with ``(V* M V) ω = V* M u`` (``V*`` the
  Euclidean adjoint, obtained by a vector-Jacobian product). The ``k × k`` normal equations are
  formed densely for ``k ≤ dense_max`` and solved by conjugate gradients otherwise;
- Riemannian gradient ``proj(M⁻¹ ∇)``;
- Christoffel contraction ``Γ(u, u) = M⁻¹ [DM(x)[u] u - ½ ∇ₓ(uᵀ M(x) u)]`` by forward- and
  reverse-mode autodiff, and ``Γ(u, v) = ¼ [Γ(u+v, u+v) - Γ(u-v, u-v)]`` by polarisation;
- retraction ``x + u``, second-order exponential map ``x + u - ½ Γ(u, u)``, exact exponential
  map by RK4 on ``ẍ = -Γ(ẋ, ẋ)``, transport by horizontal projection at the new point.

Subclasses with closed forms override the derived methods; :meth:`QuotientManifold.generic`
returns a view that uses the derived (autodiff) path anyway, for testing the closed forms.

Derived methods accept either a tensor ``x`` or a cached point ``m.at(x)``
(:class:`AtPoint`), which computes everything that depends only on ``x`` once. Primitives
receive plain tensors, unless the class sets ``point_aware = True``: then they receive the
cached point (read the tensor with :func:`as_tensor`, store point-only quantities with
``x.cached(key, compute)``), so a projection at a fixed point does not recompute them.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

import torch
from geoopt.manifolds.base import Manifold

from ..linalg import cholesky, conjugate_gradient

Tensor = torch.Tensor

_REQUIRED = {
    "lie_shape": "lie_shape(x) -> tuple, the shape of a Lie-algebra element",
    "vertical": "vertical(x, omega) -> tangent vector, the infinitesimal action",
    "metric": "metric(x, u) -> M(x) u, the metric as a linear operator",
}


class AtPoint:
    """A base point with everything that depends only on it computed once.

    ``m.at(x).proju(u)`` is ``m.proju(x, u)``, but Gram matrices, factorizations and bases are
    computed on first use and reused by later calls. The point must not change in place while
    an ``AtPoint`` of it is alive.
    """

    __slots__ = ("_cache", "manifold", "x")

    def __init__(self, manifold, x: Tensor):
        self.manifold = manifold
        self.x = x
        self._cache: dict[str, object] = {}

    def cached(self, key: str, compute: Callable[[], object]):
        """``compute()`` on first request of ``key``, the stored value afterwards."""
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = compute()
            return value

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def __getattr__(self, name: str):
        return functools.partial(getattr(self.manifold, name), self)

    def __repr__(self) -> str:
        return f"AtPoint({self.manifold!r}, shape={tuple(self.x.shape)})"


def as_tensor(x) -> Tensor:
    """The tensor of a point given as a tensor or an :class:`AtPoint`."""
    return x.x if isinstance(x, AtPoint) else x


def positive_int(value, name: str, meaning: str = "") -> int:
    """``value`` as an ``int`` if it is a positive integer (numpy integers too; not ``bool``)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = 0
    if number < 1:
        meaning = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a positive integer{meaning}, got {value!r}")
    return number


class QuotientManifold(Manifold):
    """Base class of quotient manifolds given by an action and a metric (see module doc)."""

    name = "Quotient"
    ndim = 2
    reversible = False
    point_aware = False  # primitives accept an AtPoint (see the module docstring)

    def __init__(self, *, exp_steps: int = 10, dense_max: int = 64):
        super().__init__()
        missing = [
            f"{name}: {contract}"
            for name, contract in _REQUIRED.items()
            if getattr(type(self), name) is getattr(QuotientManifold, name)
        ]
        if missing:
            raise TypeError(
                f"{type(self).__name__} must define the quotient primitive(s) " + "; ".join(missing)
            )
        self.exp_steps = positive_int(exp_steps, "exp_steps")
        self.dense_max = int(dense_max)

    # ------------------------------------------------------------------ primitives
    def lie_shape(self, x: Tensor) -> tuple[int, ...]:
        """Shape of a Lie-algebra element acting at ``x`` (without batch dimensions)."""
        raise NotImplementedError

    def vertical(self, x: Tensor, omega: Tensor) -> Tensor:
        """Vertical vector ``V_x omega`` generated by the Lie-algebra element ``omega``."""
        raise NotImplementedError

    def metric(self, x: Tensor, u: Tensor) -> Tensor:
        """``M(x) u``: the metric applied to a tangent vector (a linear map of ``u``)."""
        raise NotImplementedError

    def metric_inv(self, x: Tensor, v: Tensor) -> Tensor:
        """``M(x)⁻¹ v``; by default conjugate gradients on :meth:`metric`."""
        return conjugate_gradient(lambda u: self.metric(x, u), v, event_dims=self.ndim)

    def precondition(self, x: Tensor, r: Tensor) -> Tensor:
        """Approximate inverse of the normal operator ``ω ↦ V* M V ω`` (default: identity).

        Only the iterative projection (``k > dense_max``) uses it; a good one saves most of
        the conjugate-gradient iterations.
        """
        return r

    def act(self, x: Tensor, g: Tensor) -> Tensor:
        """Finite group action ``x ↦ g · x``."""
        raise NotImplementedError(f"{type(self).__name__} defines no finite action act(x, g)")

    def push(self, x: Tensor, u: Tensor, g: Tensor) -> Tensor:
        """Differential of the action on a tangent vector ``u`` at ``x``."""
        raise NotImplementedError(f"{type(self).__name__} defines no push(x, u, g)")

    # ------------------------------------------------------------------ points
    def at(self, x) -> AtPoint:
        """The point ``x`` with its point-only quantities cached (see :class:`AtPoint`)."""
        if isinstance(x, AtPoint) and (x.manifold is self or x.manifold.generic_of is self):
            return x
        x = as_tensor(x)
        if not isinstance(x, Tensor):
            raise TypeError(f"a point must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"a point must have a floating dtype, got {x.dtype}")
        ok, reason = self._check_shape(x.shape, "x")
        if not ok:
            raise ValueError(reason)
        self._check_free(x)
        return AtPoint(self, x)

    def _check_free(self, x: Tensor) -> None:
        """Raise a ``ValueError`` where the action is not free at ``x`` (default: nothing).

        Called once per :class:`AtPoint`; subclasses whose formulas divide by the point check
        here, so that such points give an error rather than NaN.
        """

    def _check_vector(self, p: AtPoint, u: Tensor, name: str = "u") -> None:
        if not isinstance(u, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(u).__name__}")
        if u.dtype != p.x.dtype:
            raise ValueError(
                f"{name} has dtype {u.dtype}; it must be floating, with the point's {p.x.dtype}"
            )
        event = p.x.shape[p.x.dim() - self.ndim :]
        if u.shape[u.dim() - self.ndim :] != event or u.dim() < self.ndim:
            raise ValueError(
                f"{name} has shape {tuple(u.shape)}, incompatible with the point's shape "
                f"{tuple(p.x.shape)} (trailing dimensions must match)"
            )

    @property
    def generic_of(self) -> QuotientManifold | None:
        """The manifold this is the generic view of (``None``: not a view)."""
        return None

    def _point(self, p: AtPoint):
        """What the primitives receive: the cached point if ``point_aware``, else its tensor."""
        return p if self.point_aware else p.x

    def _reduce(self, a: Tensor, keepdim: bool) -> Tensor:
        return a.sum(dim=tuple(range(-self.ndim, 0)), keepdim=keepdim)

    # ------------------------------------------------------------------ metric
    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """``<u, v>_x = Σ u ⊙ M(x) v``."""
        p = self.at(x)
        self._check_vector(p, u)
        if v is None:
            v = u
        else:
            self._check_vector(p, v, "v")
        return self._reduce(u * self.metric(self._point(p), v), keepdim)

    def component_inner(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        return self.inner(x, u, v, keepdim=True)

    def norm(self, x, u: Tensor, *, keepdim: bool = False) -> Tensor:
        """``||u||_x = sqrt(<u, u>_x)``."""
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ projection
    def proju(self, x, u: Tensor) -> Tensor:
        """Horizontal projection ``u - V ω`` with ``(V* M V) ω = V* M u``."""
        p = self.at(x)
        self._check_vector(p, u)
        k = math.prod(self.lie_shape(p.x))
        if k == 0:
            return u
        if k <= self.dense_max:
            basis, m_basis, chol = p.cached("vertical_gram", lambda: self._vertical_gram(p))
            event = -self.ndim
            u = u.expand(torch.broadcast_shapes(u.shape, p.x.shape))
            rhs = torch.einsum("k...e,...e->...k", m_basis.flatten(event), u.flatten(event))
            omega = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
            shift = torch.einsum("...k,k...e->...e", omega, basis.flatten(event))
            return u - shift.reshape(u.shape)
        x = self._point(p)
        adjoint = p.cached("vertical_adjoint", lambda: self._vertical_adjoint(p))
        omega = conjugate_gradient(
            lambda w: adjoint(self.metric(x, self.vertical(x, w))),
            adjoint(self.metric(x, u)),
            event_dims=len(self.lie_shape(p.x)),
            precondition=lambda r: self.precondition(x, r),
        )
        return u - self.vertical(x, omega)

    def _lie_zeros(self, x: Tensor) -> Tensor:
        batch = x.shape[: x.dim() - self.ndim]
        return x.new_zeros(*batch, *self.lie_shape(x))

    def _vertical_gram(self, p: AtPoint):
        """Vertical basis ``V e_i``, ``M V e_i`` and the Cholesky factor of ``V* M V``."""
        lie = self.lie_shape(p.x)
        batch = p.x.shape[: p.x.dim() - self.ndim]
        x = self._point(p)
        k = math.prod(lie)
        eye = torch.eye(k, dtype=p.x.dtype, device=p.x.device)
        omegas = eye.reshape(k, *[1] * len(batch), *lie).expand(k, *batch, *lie)
        basis = torch.func.vmap(lambda w: self.vertical(x, w))(omegas)
        m_basis = torch.func.vmap(lambda b: self.metric(x, b))(basis)
        flat = (k, *batch, -1)
        gram = torch.einsum("i...e,j...e->...ij", basis.reshape(flat), m_basis.reshape(flat))
        chol = cholesky(0.5 * (gram + gram.transpose(-1, -2)), "the vertical Gram matrix V*MV")
        return basis, m_basis, chol

    def _vertical_adjoint(self, p: AtPoint):
        """The Euclidean adjoint ``w ↦ V* w`` of the (linear) vertical map, by a VJP."""
        x = self._point(p)
        _, adjoint_fn = torch.func.vjp(lambda w: self.vertical(x, w), self._lie_zeros(p.x))
        return lambda w: adjoint_fn(w)[0]

    def egrad2rgrad(self, x, u: Tensor) -> Tensor:
        """Riemannian gradient ``proj(M⁻¹ ∇)`` from the Euclidean gradient ``∇``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        return self.proju(p, self.metric_inv(self._point(p), u))

    # ------------------------------------------------------------------ geodesics
    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Christoffel contraction ``Γ(u, v)`` (``v=None``: ``Γ(u, u)``)."""
        if v is not None:
            return 0.25 * (self.christoffel(x, u + v) - self.christoffel(x, u - v))
        p = self.at(x)
        self._check_vector(p, u)
        # forward-mode AD needs equal shapes, and memory that is not shared between entries
        shape = torch.broadcast_shapes(p.x.shape, u.shape)
        X, u = p.x.expand(shape).contiguous(), u.expand(shape).contiguous()

        def apply_metric(y: Tensor) -> Tensor:
            return self.metric(y, u)

        _, dM_u_u = torch.func.jvp(apply_metric, (X,), (u,))
        _, vjp_fn = torch.func.vjp(apply_metric, X)
        (grad_uMu,) = vjp_fn(u)
        return self.metric_inv(self._point(p), dM_u_u - 0.5 * grad_uMu)

    def retr(self, x, u: Tensor) -> Tensor:
        """First-order retraction ``x + u``."""
        return as_tensor(x) + u

    def expmap2(self, x, u: Tensor) -> Tensor:
        """Second-order approximation of the exponential map ``x + u - ½ Γ(u, u)``."""
        return as_tensor(x) + u - 0.5 * self.christoffel(x, u)

    def expmap(self, x, u: Tensor, *, steps: int | None = None) -> Tensor:
        """Exact exponential map: RK4 on ``ẍ = -Γ(ẋ, ẋ)`` over ``t ∈ [0, 1]``."""
        return self.geodesic(x, u, steps=steps)[0]

    def geodesic(self, x, u: Tensor, *, steps: int | None = None) -> tuple[Tensor, Tensor]:
        """End point and end velocity ``(γ(1), γ'(1))`` of the geodesic from ``(x, u)``, RK4."""
        steps = self.exp_steps if steps is None else int(steps)
        if steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        self._check_vector(self.at(x), u)
        h = 1.0 / steps
        y, v = as_tensor(x), u

        def accel(y: Tensor, v: Tensor) -> Tensor:
            return -self.christoffel(y, v)

        acceleration = accel(y, v)  # at the start point: its errors are the point's own
        for step in range(steps):
            try:
                k1y, k1v = v, acceleration if step == 0 else accel(y, v)
                k2y, k2v = v + 0.5 * h * k1v, accel(y + 0.5 * h * k1y, v + 0.5 * h * k1v)
                k3y, k3v = v + 0.5 * h * k2v, accel(y + 0.5 * h * k2y, v + 0.5 * h * k2v)
                k4y, k4v = v + h * k3v, accel(y + h * k3y, v + h * k3v)
            except ValueError as err:
                raise ValueError(
                    f"the geodesic left the manifold during RK4 step {step + 1}/{steps} (the "
                    "tangent vector is too long for this point, or the step count too low): "
                    "use a shorter vector or more steps"
                ) from err
            y = y + (h / 6) * (k1y + 2 * k2y + 2 * k3y + k4y)
            v = v + (h / 6) * (k1v + 2 * k2v + 2 * k3v + k4v)
        return y, v

    # ------------------------------------------------------------------ transport
    def transp(self, x, y: Tensor, v: Tensor) -> Tensor:
        """Vector transport by horizontal projection at the new point ``y``."""
        return self.proju(y, v)

    def retr_transp(self, x, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    def expmap_transp(self, x, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        y = self.expmap(x, u)
        return y, self.transp(x, y, v)

    def transp_follow_retr(self, x, u: Tensor, v: Tensor) -> Tensor:
        return self.retr_transp(x, u, v)[1]

    def transp_follow_expmap(self, x, u: Tensor, v: Tensor) -> Tensor:
        return self.expmap_transp(x, u, v)[1]

    def projx(self, x: Tensor) -> Tensor:
        """Every admissible point represents itself: the identity."""
        return x

    def _checked_size(self, size) -> tuple[int, ...]:
        """``random(2, 3)`` or ``random((2, 3))``, validated by :meth:`_check_shape`."""
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        ok, reason = self._check_shape(size, "size")
        if not ok:
            raise ValueError(reason)
        return size

    def random(self, *size, dtype=None, device=None, **kwargs) -> Tensor:
        """Standard Gaussian entries (override where that is not an admissible point)."""
        return torch.randn(*self._checked_size(size), dtype=dtype, device=device)

    def origin(self, *size, dtype=None, device=None, seed=42) -> Tensor:
        """All ones (override where that is not an admissible point)."""
        return torch.ones(*self._checked_size(size), dtype=dtype, device=device)

    # ------------------------------------------------------------------ not available
    def dist(self, x, y, *, keepdim=False):
        raise NotImplementedError(
            f"{self.name}: no closed form is known for the quotient distance; "
            "use expmap/expmap2 and norms of tangent vectors instead"
        )

    def logmap(self, x, y):
        raise NotImplementedError(
            f"{self.name}: no closed form is known for the logarithm map of this quotient"
        )

    # ------------------------------------------------------------------ checks
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        x = as_tensor(x)
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        return True, None

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        """Horizontality: ``||u - proj(u)||_x ≤ atol + rtol ||u||_x``."""
        p = self.at(x)
        gap = self.norm(p, u - self.proju(p, u))
        bound = atol + rtol * self.norm(p, u)
        if bool((gap <= bound).all()):
            return True, None
        return False, f"vector is not horizontal: max ||u - proj(u)|| = {gap.max().item():.3e}"

    # ------------------------------------------------------------------ generic path
    def generic(self) -> GenericPath:
        """This manifold computed through the generic (autodiff) path of the base class."""
        return GenericPath(self)


_DERIVED = (
    "at",
    "inner",
    "component_inner",
    "norm",
    "proju",
    "egrad2rgrad",
    "metric_inv",
    "christoffel",
    "retr",
    "expmap2",
    "expmap",
    "geodesic",
    "transp",
    "_check_vector_on_tangent",
)


class GenericPath:
    """A view of a :class:`QuotientManifold` whose derived methods are the base-class ones.

    Only the primitives (``lie_shape``, ``vertical``, ``metric``, the action) of the wrapped
    manifold are used, so comparing ``m.generic().proju(x, u)`` with ``m.proju(x, u)`` checks
    a closed form against an independent computation.
    """

    def __init__(self, manifold: QuotientManifold):
        self._manifold = manifold

    @property
    def generic_of(self) -> QuotientManifold:
        return self._manifold

    def __getattr__(self, name: str):
        if name in _DERIVED:
            return getattr(QuotientManifold, name).__get__(self)
        return getattr(self._manifold, name)

    def __repr__(self) -> str:
        return f"GenericPath({self._manifold!r})"
