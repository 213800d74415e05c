r"""Generic quotient manifold :math:`\mathcal M / \mathcal G` from a group action and a metric.

A subclass supplies three primitives (``abc.abstractmethod``), each batched over leading
dimensions and each receiving the base point ``p`` as an :class:`AtPoint` (its tensor is
``p.x``; quantities that depend only on the point are stored with ``p.cached(key, compute)``):

- ``lie_shape(p)``: the shape of a Lie-algebra element ``ω`` (dimension ``k = prod``);
- ``vertical(p, ω)``: the infinitesimal action, a linear map ``ω ↦ V_x ω`` from the Lie
  algebra to tangent vectors at ``x`` (its image is the vertical space);
- ``metric(p, u)``: the metric as a linear operator ``u ↦ M(x) u``;

and optionally ``metric_inv(p, v)`` (otherwise conjugate gradients on ``metric``),
``isotropic(p, e)`` (otherwise a dense Cholesky factor of ``M(x)``), ``precondition(p, r)``
(an approximate inverse of ``V* M V`` for the iterative projection) and the finite action
``act(x, g)`` / ``push(x, u, g)``. Everything else is derived:

- inner product ``<u, v>_x = Σ u ⊙ M(x) v`` over the point's trailing ``ndim`` dimensions;
- horizontal projection ``proj(u) = u - V ω`` with ``(V* M V) ω = V* M u`` (``V*`` the
  Euclidean adjoint, obtained by a vector-Jacobian product). The ``k × k`` normal equations are
  formed densely for ``k ≤ dense_max`` and solved by conjugate gradients otherwise;
- Riemannian gradient ``proj(M⁻¹ ∇)``;
- random horizontal direction ``proj(T e)``, ``e ~ N(0, I)``, ``Tᵀ M T = I``: the standard
  Gaussian of the metric, projected;
- Christoffel contraction ``Γ(u, u) = M⁻¹ [DM(x)[u] u - ½ ∇ₓ(uᵀ M(x) u)]`` by forward- and
  reverse-mode autodiff, and ``Γ(u, v) = ¼ [Γ(u+v, u+v) - Γ(u-v, u-v)]`` by polarisation;
- retraction ``x + u``, second-order exponential map ``x + u - ½ Γ(u, u)`` and its
  vector-Jacobian product (reverse-mode autodiff), exact exponential map by RK4 on
  ``ẍ = -Γ(ẋ, ẋ)`` (step count from the velocity, :mod:`.ode`), transport by horizontal
  projection at the new point.

Subclasses with closed forms override the derived methods; :meth:`QuotientManifold.generic`
returns the same quotient computed by the derived (autodiff) path anyway, for testing the
closed forms. Every derived method accepts a tensor ``x`` or a cached point ``m.at(x)``, which
computes everything that depends only on ``x`` once.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
import math
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

with warnings.catch_warnings():
    # geoopt 0.5 decorates helpers with torch.jit.script, which torch now deprecates: silence
    # that one warning while geoopt is imported, and no other (the filters are restored after)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning
    )
    from geoopt.manifolds.base import Manifold

from ..linalg import cholesky, conjugate_gradient
from ..validation import is_real, positive_int
from .groups import DEFAULT_CONDITION, random_exp
from .ode import controlled, rk4, steps_for

if TYPE_CHECKING:
    from .gl.damping import BallDamping, FrameDamping
    from .quotient import GenericPath

Tensor = torch.Tensor
T = TypeVar("T")

#: The metric of every shipped quotient whose metric is a choice (GL pairs, their rotary
#: subgroup, re-scaling pairs) when none is named, in the manifolds, in
#: :meth:`~quotientgeo.ParameterGeometry.add_gl_pair` and in
#: :func:`~quotientgeo.find_symmetries`.
DEFAULT_METRIC = "mix"

__all__ = ["DEFAULT_METRIC", "AtPoint", "QuotientManifold", "metric_variant"]

_SPEED: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "quotientgeo_speed", default=None
)


@contextlib.contextmanager
def speeds_at_most(speed: float | None) -> Iterator[None]:
    """Inside, every exponential map and geodesic is taken along a velocity whose norm in the
    manifold's metric, times ``|t|``, is at most ``speed`` (``None``: no bound): a promise of
    the caller (a ball's radius, where the ball is in that metric) from which a manifold may
    size its work on the host. The inv metric's closed-form geodesic takes its matrix
    exponentials' squarings from it (:func:`speed_bound`) instead of the most that
    :func:`~quotientgeo.linalg.deferred_checks` allows. A velocity beyond the promise is not
    computed wrongly: its exponentials fail their checks as ever."""
    token = _SPEED.set(speed)
    try:
        yield
    finally:
        _SPEED.reset(token)


def speed_bound() -> float | None:
    """The bound of the innermost :func:`speeds_at_most` (``None`` outside one)."""
    return _SPEED.get()


def metric_variant(
    cls: type, family: type, metric: str | float | None, variants: dict[str | type, type]
) -> type:
    """The class that ``cls(..., metric)`` constructs, for a ``family`` with one class per metric.

    ``variants`` maps each metric's name (and ``float``, for a real interpolation weight) to its
    class. ``family`` itself gives way to the class of ``metric`` (``DEFAULT_METRIC`` when
    ``None``), as geoopt's ``Stiefel(canonical=...)`` does; a class below it stays, and must be
    the class of ``metric`` where one is named.
    """
    key = DEFAULT_METRIC if metric is None else metric
    found = variants.get(key) if isinstance(key, str) else None
    if found is None and is_real(key):
        found = variants.get(float)
    if found is None:
        names = [repr(name) for name in sorted(k for k in variants if isinstance(k, str))]
        names += ["a number s in [0, 1]"] if float in variants else []
        message = f"metric must be {', '.join(names[:-1])} or {names[-1]}, got {metric!r}"
        if is_real(key):
            message += ": the interpolated metric s is defined for GL pairs only"
        raise ValueError(message)
    if cls is family:
        return found
    if metric is not None and not issubclass(cls, found):
        raise ValueError(f"{cls.__name__} does not have the metric {metric!r}")
    return cls


class AtPoint:
    """A base point ``x`` of ``manifold`` and a cache of quantities that depend only on ``x``.

    Plain data: ``x`` (the tensor), ``manifold`` (the owner, whose methods fill the cache) and
    ``cache`` (a dict). The point must not change in place while an ``AtPoint`` of it is alive.
    """

    __slots__ = ("cache", "manifold", "x")

    def __init__(self, manifold: QuotientManifold, x: Tensor):
        self.manifold: QuotientManifold = manifold
        self.x: Tensor = x
        self.cache: dict[str, Any] = {}  # each value is what compute() of its key returned

    def cached(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` on first request of ``key``, the stored value afterwards."""
        try:
            return self.cache[key]
        except KeyError:
            value = self.cache[key] = compute()
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

    def __repr__(self) -> str:
        return f"AtPoint({self.manifold!r}, shape={tuple(self.x.shape)})"


class QuotientManifold(Manifold):
    """Base class of quotient manifolds given by an action and a metric (see module doc).

    Args:
        exp_steps: RK4 steps of the integrated geodesics; ``None`` (default) chooses them per
            call from the velocity for a stated accuracy (:meth:`rk4_steps`).
        dense_max: largest Lie-algebra dimension ``k`` for which :meth:`proju` forms the
            normal equations densely (conjugate gradients above).
    """

    name = "Quotient"
    ndim = 2
    reversible = False
    #: ``True`` where :meth:`expmap` is a closed form rather than an integration: the default
    #: perturbation of the sharpness measures is then the exact geodesic.
    closed_form_geodesic: bool = False
    #: The metric this quotient was built with, where it is one of several choices
    #: (``"inv"``, ``"mix"`` or an interpolation weight ``s``); ``None`` where the metric is
    #: part of the manifold's definition. A geometry is measured in the metric it declares.
    metric_name: str | float | None = None

    def __init__(self, *, exp_steps: int | None = None, dense_max: int = 64):
        super().__init__()
        self.exp_steps: int | None = (
            None if exp_steps is None else positive_int("exp_steps", exp_steps)
        )
        self.dense_max: int = int(dense_max)

    # ------------------------------------------------------------------ primitives
    @abc.abstractmethod
    def lie_shape(self, p: AtPoint) -> tuple[int, ...]:
        """Shape of a Lie-algebra element acting at ``p`` (without batch dimensions)."""

    @abc.abstractmethod
    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """Vertical vector ``V_x ω`` generated by the Lie-algebra element ``ω``."""

    @abc.abstractmethod
    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``M(x) u``: the metric applied to a tangent vector (a linear map of ``u``)."""

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``M(x)⁻¹ v``; by default conjugate gradients on :meth:`metric`."""
        return conjugate_gradient(lambda u: self.metric(p, u), v, event_dims=self.ndim)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``T e`` with ``Tᵀ M(x) T = I``: maps ``e ~ N(0, I)`` to ``N(0, M(x)⁻¹)``.

        By default ``T = L⁻ᵀ`` for the Cholesky factor ``M = L Lᵀ`` of the metric as a dense
        ``D × D`` matrix per point (``D`` entries in a point): ``O(D³)``, so shipped manifolds
        give closed forms.
        """
        L = p.cached("metric_cholesky", lambda: self._metric_cholesky(p))
        event = p.x.shape[p.x.dim() - self.ndim :]
        e = e.expand(torch.broadcast_shapes(e.shape, p.x.shape))
        flat = e.reshape(*e.shape[: e.dim() - self.ndim], -1, 1)
        xi = torch.linalg.solve_triangular(L.mT, flat, upper=True)
        return xi.reshape(*e.shape[: e.dim() - self.ndim], *event)

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
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

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Tensor:
        """A random group element ``g = scale · exp(ω)`` for :meth:`act` at ``x``, one per batch
        entry, with condition number at most ``condition``.

        ``exp`` is the matrix exponential for square Lie shapes ``(h, h)``: ``ω`` is a standard
        Gaussian of the Lie-algebra shape rescaled to spectral norm ``r · ½ log(condition)``,
        ``r`` uniform in ``[0, 1]`` (``‖exp(±ω)‖₂ ≤ e^{‖ω‖₂}``, so ``cond(g) ≤ condition``;
        a rescaled ``ω`` stays in any subspace the Gaussian lies in). Otherwise (scalings)
        ``exp`` is element-wise and each entry of ``ω`` is uniform in
        ``[-½ log c, ½ log c]``: factors log-uniform in ``[c^{-1/2}, c^{1/2}]``, any two
        within a factor ``c = condition`` of each other (``groups.random_exp``).
        ``scale > 0`` keeps ``g`` in the identity component. Override where :meth:`act` takes
        its group elements in another form.
        """
        p = self.at(x)
        batch = p.x.shape[: p.x.dim() - self.ndim]
        return random_exp(
            self.lie_shape(p),
            batch,
            generator=generator,
            dtype=p.x.dtype,
            device=p.x.device,
            scale=scale,
            condition=condition,
        )

    def group_name(self, shape: tuple[int, ...]) -> str:
        """Readable name of the symmetry group acting on points of ``shape`` (for summaries)."""
        return f"the group of {type(self).__name__}"

    def with_metric(
        self, metric: str | float, *, eps: float | BallDamping | FrameDamping | None = None
    ) -> QuotientManifold:
        """This quotient with the metric named by ``metric`` (sharpness's ``metric=`` switch).

        A manifold whose metric is part of its definition (the default) returns itself;
        the GL and re-scaling quotients return their ``"inv"`` / ``"mix"`` (/ interpolated)
        variant.
        """
        return self

    # ------------------------------------------------------------------ points
    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
        """``(ok, reason)`` for a point shape; subclasses refine it (geoopt's hook)."""
        # geoopt annotates shape as Tuple[int] (a 1-tuple) for a tuple of any length
        result = super()._check_shape(shape, name)  # pyright: ignore[reportArgumentType]
        return result if isinstance(result, tuple) else (result, None)

    def at(self, x: Tensor | AtPoint) -> AtPoint:
        """The point ``x`` with its point-only quantities cached (see :class:`AtPoint`)."""
        if isinstance(x, AtPoint):
            if x.manifold is self:
                return x
            x = x.x
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

    def _reduce(self, a: Tensor, keepdim: bool) -> Tensor:
        return a.sum(dim=tuple(range(-self.ndim, 0)), keepdim=keepdim)

    def geometry_key(self) -> Hashable:
        """Equal for manifolds of the same class and parameters (blocks on them batch together).

        Built from the class, the ``repr`` (``extra_repr`` and sub-modules) and the public
        attributes.
        """
        state = tuple(sorted((k, repr(v)) for k, v in vars(self).items() if k[0] != "_"))
        return type(self), repr(self), state

    # ------------------------------------------------------------------ metric
    def _pair_at(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None) -> tuple[AtPoint, Tensor]:
        """The cached point and ``v`` (``u`` when ``None``), both vectors checked."""
        p = self.at(x)
        self._check_vector(p, u)
        if v is None:
            return p, u
        self._check_vector(p, v, "v")
        return p, v

    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        """``<u, v>_x = Σ u ⊙ M(x) v``."""
        p, v = self._pair_at(x, u, v)
        return self._reduce(u * self.metric(p, v), keepdim)

    def norm(self, x: Tensor | AtPoint, u: Tensor, *, keepdim: bool = False) -> Tensor:
        """``||u||_x = sqrt(<u, u>_x)``."""
        return self.inner(x, u, keepdim=keepdim).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ projection
    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """Horizontal projection ``u - V ω`` with ``(V* M V) ω = V* M u``."""
        p = self.at(x)
        self._check_vector(p, u)
        k = math.prod(self.lie_shape(p))
        if k == 0:
            return u
        if k <= self.dense_max:
            key = self._group_key("vertical_gram", p)
            basis, m_basis, chol = p.cached(key, lambda: self._vertical_gram(p))
            event = -self.ndim
            u = u.expand(torch.broadcast_shapes(u.shape, p.x.shape))
            rhs = torch.einsum("k...e,...e->...k", m_basis.flatten(event), u.flatten(event))
            omega = torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
            shift = torch.einsum("...k,k...e->...e", omega, basis.flatten(event))
            return u - shift.reshape(u.shape)
        adjoint = p.cached(
            self._group_key("vertical_adjoint", p), lambda: self._vertical_adjoint(p)
        )
        omega = conjugate_gradient(
            lambda w: adjoint(self.metric(p, self.vertical(p, w))),
            adjoint(self.metric(p, u)),
            event_dims=len(self.lie_shape(p)),
            precondition=lambda r: self.precondition(p, r),
        )
        return u - self.vertical(p, omega)

    def _group_key(self, key: str, p: AtPoint) -> str:
        """The cache key of a quantity that depends on this manifold's group: ``key`` on its own
        points, qualified by this manifold on the point of another (a total space's point, which
        quotients by other groups share)."""
        return key if p.manifold is self else f"{key}@{id(self)}"

    def _basis(self, p: AtPoint, shape: tuple[int, ...]) -> Tensor:
        """The standard basis of tensors of ``shape``, as ``(k, *batch, *shape)`` (broadcast)."""
        batch = p.x.shape[: p.x.dim() - self.ndim]
        k = math.prod(shape)
        eye = torch.eye(k, dtype=p.x.dtype, device=p.x.device)
        return eye.reshape(k, *[1] * len(batch), *shape).expand(k, *batch, *shape)

    def _vertical_gram(self, p: AtPoint):
        """Vertical basis ``V e_i``, ``M V e_i`` and the Cholesky factor of ``V* M V``."""
        omegas = self._basis(p, self.lie_shape(p))
        basis = torch.func.vmap(lambda w: self.vertical(p, w))(omegas)
        m_basis = torch.func.vmap(lambda b: self.metric(p, b))(basis)
        flat = (basis.shape[0], *p.x.shape[: p.x.dim() - self.ndim], -1)
        gram = torch.einsum("i...e,j...e->...ij", basis.reshape(flat), m_basis.reshape(flat))
        chol = cholesky(0.5 * (gram + gram.transpose(-1, -2)), "the vertical Gram matrix V*MV")
        return basis, m_basis, chol

    def _metric_cholesky(self, p: AtPoint) -> Tensor:
        """Cholesky factor of the metric as a dense matrix ``(*batch, D, D)``."""
        basis = self._basis(p, p.x.shape[p.x.dim() - self.ndim :])
        m_basis = torch.func.vmap(lambda b: self.metric(p, b))(basis)
        flat = (basis.shape[0], *p.x.shape[: p.x.dim() - self.ndim], -1)
        gram = torch.einsum("i...e,j...e->...ij", basis.reshape(flat), m_basis.reshape(flat))
        return cholesky(0.5 * (gram + gram.transpose(-1, -2)), "the metric M(x)")

    def _vertical_adjoint(self, p: AtPoint):
        """The Euclidean adjoint ``w ↦ V* w`` of the (linear) vertical map, by a VJP."""
        batch = p.x.shape[: p.x.dim() - self.ndim]
        zeros = p.x.new_zeros(*batch, *self.lie_shape(p))
        adjoint_fn = torch.func.vjp(lambda w: self.vertical(p, w), zeros)[1]
        return lambda w: adjoint_fn(w)[0]

    def egrad2rgrad(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """Riemannian gradient ``proj(M⁻¹ ∇)`` from the Euclidean gradient ``∇``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        return self.proju(p, self.metric_inv(p, u))

    def random_tangent(
        self, x: Tensor | AtPoint, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """A random horizontal vector ``proj(T e)``, ``e ~ N(0, I)`` (see :meth:`isotropic`):
        isotropic in the metric before the projection, so in the horizontal space too."""
        p = self.at(x)
        e = torch.randn(p.x.shape, generator=generator, dtype=p.x.dtype, device=p.x.device)
        return self.proju(p, self.isotropic(p, e))

    # ------------------------------------------------------------------ geodesics
    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Christoffel contraction ``Γ(u, v)`` (``v=None``: ``Γ(u, u)``)."""
        if v is not None:
            return 0.25 * (self.christoffel(x, u + v) - self.christoffel(x, u - v))
        p = self.at(x)
        self._check_vector(p, u)
        # forward-mode AD needs equal shapes, and memory that is not shared between entries
        shape = torch.broadcast_shapes(p.x.shape, u.shape)
        X, u = p.x.expand(shape).contiguous(), u.expand(shape).contiguous()

        def apply_metric(y: Tensor) -> Tensor:
            return self.metric(AtPoint(self, y), u)

        dM_u_u = torch.func.jvp(apply_metric, (X,), (u,))[1]
        vjp_fn = torch.func.vjp(apply_metric, X)[1]
        (grad_uMu,) = vjp_fn(u)
        return self.metric_inv(p, dM_u_u - 0.5 * grad_uMu)

    def retr(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """First-order retraction ``x + u``."""
        return self.at(x).x + u

    def expmap2(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """Second-order approximation of the exponential map ``x + u - ½ Γ(u, u)``."""
        p = self.at(x)
        return torch.sub(p.x + u, self.christoffel(p, u), alpha=0.5)

    def expmap2_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        """``J(u)ᵀ d`` with ``J`` the Jacobian of ``u ↦ expmap2(x, u)``: the gradient with
        respect to ``u`` of a function of ``expmap2(x, u)`` whose gradient there is ``d``. Here
        by reverse-mode autodiff through :meth:`expmap2`; closed forms in subclasses. Not
        differentiable itself."""
        return _vjp(functools.partial(self.expmap2, self.at(x)), u, d)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """Exact exponential map ``γ(1)`` (:meth:`geodesic`)."""
        return self.geodesic(x, u, steps=steps)[0]

    def expmap_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        """``J(u)ᵀ d`` with ``J`` the Jacobian of ``u ↦ expmap(x, u)`` (:meth:`expmap2_vjp`'s
        counterpart): here by reverse-mode autodiff through :meth:`expmap`; closed forms in
        subclasses. Not differentiable itself."""
        return _vjp(functools.partial(self.expmap, self.at(x)), u, d)

    def geodesic(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor = 1.0, *, steps: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(γ(t), γ'(t))`` of the geodesic from ``(x, u)``: RK4 on ``ẍ = -Γ(ẋ, ẋ)``.

        ``t`` is a number or a tensor broadcastable to the batch dimensions; the step count is
        ``steps``, else :attr:`exp_steps`, else chosen from the velocity (:meth:`rk4_steps`).
        """
        p = self.at(x)
        self._check_vector(p, u)
        t = self._times(t, p, u)

        def run(n: int) -> tuple[Tensor, Tensor]:
            y, v = rk4(lambda y, v: (-self.christoffel(y, v),), (p.x,), (u,), t, n)
            return y, v

        return self._integrated(run, p, u, t, steps)

    def _integrated(
        self,
        run: Callable[[int], tuple[Tensor, Tensor]],
        p: AtPoint,
        u: Tensor,
        t: Tensor,
        steps: int | None,
    ) -> tuple[Tensor, Tensor]:
        """``run(N)``: ``N = steps``, else :attr:`exp_steps`, else from :meth:`rk4_steps` with
        the error of the end point checked (:func:`~quotientgeo.manifolds.ode.controlled`) in
        the metric norm at ``p``, so that every point of an orbit takes the same steps."""
        n = self.rk4_steps(p, u, t, steps)
        if steps is not None or self.exp_steps is not None:
            return run(n)
        return controlled(run, n, p.x, self.ndim, lambda w: self.norm(p, w))

    def rk4_steps(self, p: AtPoint, u: Tensor, t: Tensor, steps: int | None = None) -> int:
        """RK4 steps for the geodesic from ``(p, u)`` over ``[0, t]``.

        ``steps``, else :attr:`exp_steps`, else ``⌈κ (16 / rtol)^{1/4}⌉`` with the rate
        ``κ = max |t| ||Γ(u, u)||_x / ||u||_x`` over the batch (metric norms, so the count is
        the same at every point of an orbit; one Christoffel contraction and one read on the
        host), for a relative error of the end point below ``rtol`` (to the displacement, in
        the metric at ``p``; ``1e-8`` in float64, ``1e-5`` otherwise; see
        :mod:`quotientgeo.manifolds.ode`).
        """
        if steps is not None:
            return positive_int("steps", steps)
        if self.exp_steps is not None:
            return self.exp_steps
        with torch.no_grad():
            speed = self.norm(p, u)
            accel = self.norm(p, self.christoffel(p, u))
            times = t.reshape(t.shape[: t.dim() - self.ndim]).abs()
            rate = torch.where(speed > 0, accel / speed, 0.0) * times
            rate = float(rate.max()) if rate.numel() else 0.0
        return steps_for(rate, p.x.dtype)

    def _times(self, t: float | Tensor, p: AtPoint, u: Tensor) -> Tensor:
        """``t`` as a tensor of the point's dtype and device, shaped ``(*batch, 1, …, 1)``."""
        t = torch.as_tensor(t, dtype=p.x.dtype, device=p.x.device)
        if not t.dtype.is_floating_point:
            raise ValueError(f"t must be a real number or a floating tensor, got {t.dtype}")
        return t.reshape(*t.shape, *[1] * self.ndim)

    # ------------------------------------------------------------------ transport
    def transp(self, x: Tensor | AtPoint, y: Tensor, v: Tensor) -> Tensor:
        """Vector transport by horizontal projection at the new point ``y``."""
        return self.proju(y, v)

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

    def random(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Standard Gaussian entries (override where that is not an admissible point)."""
        return torch.randn(*self._checked_size(size), dtype=dtype, device=device)

    def origin(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int = 42,
    ) -> Tensor:
        """All ones (override where that is not an admissible point)."""
        return torch.ones(*self._checked_size(size), dtype=dtype, device=device)

    # ------------------------------------------------------------------ not available
    def dist(self, x: Tensor, y: Tensor, *, keepdim: bool = False) -> Tensor:
        raise NotImplementedError(
            f"{self.name}: no closed form is known for the quotient distance; "
            "use expmap/expmap2 and norms of tangent vectors instead"
        )

    def logmap(self, x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError(
            f"{self.name}: no closed form is known for the logarithm map of this quotient"
        )

    # ------------------------------------------------------------------ checks
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        x = x.x if isinstance(x, AtPoint) else x
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
    def generic(self, *, metric_inv: bool = False) -> GenericPath:
        """This quotient computed through the derived (autodiff) methods of the base class.

        ``metric_inv=True`` keeps this manifold's own ``M⁻¹`` (otherwise conjugate gradients).
        """
        # imported here: quotient.py subclasses QuotientManifold, so it imports this module
        from .quotient import GenericPath

        return GenericPath(self, metric_inv=metric_inv)


def _vjp(f: Callable[[Tensor], Tensor], u: Tensor, d: Tensor) -> Tensor:
    """``J(u)ᵀ d`` of ``f`` at ``u`` by reverse-mode autodiff (a detached result)."""
    with torch.enable_grad():
        leaf = u.detach().requires_grad_(True)
        (out,) = torch.autograd.grad(f(leaf), leaf, d)
    return out
