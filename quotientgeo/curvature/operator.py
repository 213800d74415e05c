r"""The Riemannian Hessian of a model's loss in its parameter geometry, as a linear operator.

At the model's weights ``x``, with ``f`` the batch-averaged loss, ``G(x)`` the metric and ``Γ_x``
its Christoffel contraction, every curve with ``γ(0) = x``, ``γ'(0) = ξ`` and
``γ''(0) = -Γ_x(ξ, ξ)`` (a geodesic, or the second-order map ``x + ξ - ½Γ(ξ, ξ)`` of the
sharpness measures) gives

    ``f(γ(t)) = f(x) + t ∇f·ξ + ½ t² (ξᵀ ∇²f ξ - ∇f · Γ_x(ξ, ξ)) + O(t³)``.

The symmetric bilinear form ``b(η, ξ) = ηᵀ ∇²f ξ - ∇f · Γ_x(η, ξ)`` is the Riemannian Hessian
``⟨η, Hess f(x)[ξ]⟩_x``, and ``Hess f(x)[ξ] = G⁻¹ (∇²f ξ - c(ξ))`` with the covector
``c(ξ)·η = ∇f · Γ_x(η, ξ)``. It equals ``D(grad f)(x)[ξ] + Γ_x(ξ, grad f(x))`` of the
Levi-Civita connection; the second term, which carries ``∇f``, vanishes only at critical
points. On the quotient, for horizontal ``ξ``, the Hessian of the quotient lifts to
``P^h Hess f(x)[ξ]`` (the horizontal projection). This operator is

    ``Hess ξ = P^h G⁻¹ (∇²f - c) P^h ξ``,

self-adjoint in ``G``, zero on the vertical directions. Its parts: each kind of symmetry
blocks in the metric it declares; the adaptive rest in the element-wise metric ``1/ŵ²`` frozen
at ``x``, moving along straight lines (``Γ = 0``), as the sharpness measures move it; with
``geometry="euclidean"`` every part in the Euclidean metric (``G = I``, ``Γ = 0``, no
projection): the plain Hessian ``∇²f``.

In whitened coordinates ``z`` (``ξ = T z`` with ``Tᵀ G T = I``, per head from the cached
Cholesky factor of its metric weight) the operator is

    ``A z = Tᵀ (P^h)ᵀ (∇²f - c) P^h T z``,

symmetric in the Euclidean sense, with the eigenvalues of ``Hess`` on the horizontal space and
zeros on the (whitened) vertical directions: the form eigensolvers and trace estimators take
(``A @ z``, :meth:`~RiemannianHessian.to_scipy`). ``∇²f ξ`` is a Hessian-vector product by
double backward (:mod:`quotientgeo.curvature.loss`); ``c`` and the adjoint ``Tᵀ (P^h)ᵀ`` are
vector-Jacobian products of the manifolds' Christoffel contractions and projections
(:mod:`quotientgeo.curvature.parts`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import numpy as np
import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry import shards as sh
from ..geometry.symmetries import geometry_of
from ..linalg import deferred_checks
from ..manifolds import AdaptiveGeometry, BallDamping
from ..manifolds.gl.damping import waiting
from ..sharpness.checks import check_batches, check_loss_fn, check_model
from ..validation import positive_real
from .groups import Group, groups_of
from .inplace import InPlaceLoss
from .loss import BatchLoss
from .parts import FlatPart, FrozenPart, Part, QuotientPart

Tensor = torch.Tensor

__all__ = ["BlockOperator", "RiemannianHessian"]

#: A part of a vector in coordinates, or ``None`` where it was streamed into an output.
_Part = TypeVar("_Part", Tensor, Tensor | None)

GEOMETRIES = ("riemannian", "euclidean")
PRODUCTS = ("double_backward", "finite_difference")


class _SymmetricOperator:
    """``A @ v`` for ``v`` of shape ``(D,)`` or ``(D, k)``, :meth:`to_scipy` and
    :meth:`to_dense`, from ``_matmat`` on ``(D, k)`` matrices."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def _matmat(self, Z: Tensor) -> Tensor:
        raise NotImplementedError

    def __matmul__(self, v: Tensor) -> Tensor:
        if not isinstance(v, Tensor):
            raise TypeError(f"multiply a torch.Tensor, got {type(v).__name__}")
        if v.dim() not in (1, 2) or v.shape[0] != self.shape[1]:
            raise ValueError(
                f"the operator is {self.shape[0]} × {self.shape[1]}: multiply a vector "
                f"({self.shape[1]},) or a matrix ({self.shape[1]}, k), got {tuple(v.shape)}"
            )
        Z = v.to(dtype=self.dtype, device=self.device)
        out = self._matmat(Z[:, None] if v.dim() == 1 else Z)
        return out[:, 0] if v.dim() == 1 else out

    def addmv_(self, out: Tensor, z: Tensor, *, beta: float) -> Tensor:
        """``out ← β · out + A z`` in place (``torch.addmv``'s ``beta``) for vectors ``out``
        and ``z`` of shape ``(D,)``, ``out`` in the operator's dtype and on its device and not
        sharing memory with ``z``; returns ``out``. What a recurrence such as Lanczos'
        (``A v_j - β_{j-1} v_{j-1}``) needs without a third vector, where the product forms
        ``A z`` in ``out`` itself (the finite-difference :class:`RiemannianHessian`); here
        ``A z`` is formed apart and added. ``β = 0`` overwrites ``out``, whatever it holds."""
        self._check_out(out, z)
        product = self @ z
        return out.copy_(product) if beta == 0 else out.mul_(beta).add_(product)

    def _check_out(self, out: Tensor, z: Tensor) -> None:
        n = self.shape[0]
        for name, v in (("out", out), ("z", z)):
            if not isinstance(v, Tensor) or v.shape != (n,):
                got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(f"{name} must be a tensor of shape ({n},), got {got}")
        if out.dtype != self.dtype or out.device != self.device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor on {self.device}, got a "
                f"{out.dtype} tensor on {out.device}"
            )
        if out.untyped_storage().data_ptr() == z.untyped_storage().data_ptr():
            raise ValueError("out and z share memory: A z is formed while z is read")

    def to_scipy(self):
        """This operator as a ``scipy.sparse.linalg.LinearOperator`` on NumPy arrays (of the
        operator's dtype; products run in torch on its device)."""
        from scipy.sparse.linalg import LinearOperator

        dtype = torch.empty((), dtype=self.dtype).numpy().dtype

        def matmat(X):
            Z = torch.as_tensor(np.asarray(X), device=self.device).to(self.dtype)
            Z = Z.reshape(self.shape[1], -1)
            return self._matmat(Z).cpu().numpy()

        def matvec(x):
            return matmat(np.asarray(x).reshape(-1, 1)).reshape(-1)

        return LinearOperator(self.shape, matvec=matvec, rmatvec=matvec, matmat=matmat, dtype=dtype)  # pyright: ignore[reportCallIssue]

    def to_dense(self, chunk_size: int = 64) -> Tensor:
        """The whole ``D × D`` matrix, ``chunk_size`` columns per product (``D`` products: for
        small models)."""
        n = self.shape[1]
        eye = torch.eye(n, dtype=self.dtype, device=self.device)
        columns = [self._matmat(eye[:, s : s + chunk_size]) for s in range(0, n, chunk_size)]
        return torch.cat(columns, dim=1) if columns else eye


class RiemannianHessian(_SymmetricOperator):
    r"""The Riemannian Hessian of the batch-averaged loss at the model's weights (module
    docstring), matrix-free, in whitened coordinates.

    ``H @ z`` multiplies whitened vectors ``z`` of shape ``(D,)`` or matrices ``(D, k)``
    (``D = H.shape[0]``, every trainable entry once; dtype and device of the model's
    coordinates, at least float32): the symmetric ``A = Tᵀ (P^h)ᵀ (∇²f - c) P^h T``, whose
    eigenvalues are those of the quotient's Hessian on the horizontal space, and ``0`` on the
    vertical directions; :meth:`addmv_` forms ``β · out + A z`` in place (the
    finite-difference product without a second vector). :meth:`apply` gives ``Hess ξ``
    itself on tangent vectors, :meth:`tangent` and :meth:`whiten` convert between the two
    coordinates, and :meth:`to_parameters` names a vector's entries by parameter.

    Args:
        model: the network; read only. Double backward runs every product in eval mode
            through ``torch.func.functional_call`` at the weights read at construction; the
            finite difference moves the model's own parameters in place
            (:mod:`quotientgeo.curvature.inplace`) and writes them back bit-exactly. Modes,
            buffers and ``.grad`` are restored after each product, also on errors.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, as for
            :func:`~quotientgeo.geodesic_sharpness`.
        batches: an iterable of batches, read once and kept: ``f`` is the mean of
            ``loss_fn`` over them and every product runs over all of them.
        symmetries: ``"auto"`` (:func:`~quotientgeo.find_symmetries`), a
            :class:`~quotientgeo.ParameterGeometry` of ``model``, or ``None`` (every
            parameter in the adaptive geometry), as for the sharpness measures.
        metric: the metric to declare with ``symmetries="auto"`` (``"mix"``, ``"inv"`` or
            ``s``); ``None``: each block's own.
        geometry: ``"riemannian"`` (default; the symmetry blocks' quotient metrics and the
            adaptive rest) or ``"euclidean"`` (the plain Hessian ``∇²f`` in the same
            coordinates, what PyHessian and curvlinops compute).
        eps: Gram relaxation of the GL kinds (``P + eps·I``, or a
            :class:`~quotientgeo.FrameDamping` or :class:`~quotientgeo.BallDamping` with its
            radius); ``None`` keeps the declared. LoRA adapters that discovery declares with
            ``FrameDamping()`` need it: there is no ball to take the radius from.
        product: how ``∇²f ξ`` is computed: ``"double_backward"`` (default: exact, one
            forward and two backward passes per batch through the gradient's graph) or
            ``"finite_difference"``: ``(∇f(x + tξ) - ∇f(x - tξ)) / (2t)``, two ordinary
            gradients per batch of the model moved in place (no graph of the gradient is kept,
            no second derivative taken: what a sharded or very large model affords; a model
            sharded with FSDP2's ``fully_shard`` is measured as it is, every rank passing the
            same batches), error ``O(t²)``; in float32 or wider. The connection term's
            ``∇f`` is the mean of the same two gradients (``∇f(x) + O(t²)``): the operator
            keeps its base point and no gradient.
        step: the finite difference's relative step, the largest displacement of any part
            relative to its own size: ``t = step / max_p (‖ξ_p‖_∞ / s_p)`` over the parts
            ``p`` (each kind of symmetry blocks, each parameter of the adaptive rest) with
            ``s_p = max(‖x_p‖_∞, rms(x))``, so that attention weights of size 0.02 move by
            ``step`` of themselves whatever the norm weights' size. ``None``:
            ``ε^{1/3} / 8`` (:func:`default_step`) with ``ε`` the machine epsilon of the
            coordinates or of the parameters, whichever is coarser (``6.1e-4`` in float32,
            ``2.5e-2`` for bfloat16 parameters, ``7.6e-7`` in float64).

    Attributes:
        geometry: the :class:`~quotientgeo.ParameterGeometry` measured.
        geometry_kind: ``"riemannian"`` or ``"euclidean"``.
        loss: ``f`` at the weights.
        products: vectors multiplied so far (each costs one forward and two backward passes
            per batch, a matrix of ``k`` columns shares the forward and first backward).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        batches: Iterable,
        *,
        symmetries: str | ParameterGeometry | None = "auto",
        metric: str | float | None = None,
        geometry: str = "riemannian",
        eps: float | BallDamping | None = None,
        product: str = "double_backward",
        step: float | None = None,
    ):
        check_model(model)
        check_loss_fn(loss_fn)
        check_batches(batches)
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry must be 'riemannian' or 'euclidean', got {geometry!r}")
        if product not in PRODUCTS:
            raise ValueError(
                f"product must be 'double_backward' or 'finite_difference', got {product!r}"
            )
        self.product = product
        self._step = None if step is None else positive_real("step", step)
        self.geometry: ParameterGeometry = geometry_of(model, symmetries, metric, eps=eps)
        self.geometry_kind = geometry
        if product == "double_backward" and sh.sharded_parameters(self.geometry.params.values()):
            raise ValueError(
                "the double-backward product cannot measure a model sharded over ranks (FSDP2): "
                "its torch.func.functional_call bypasses FSDP's hooks; pass "
                "product='finite_difference', which moves the sharded parameters in place"
            )
        manifolds = self.geometry.manifolds()
        for i, m in enumerate(manifolds):
            damping = getattr(m, "eps", None)
            if waiting(damping):
                kind = type(damping).__name__
                raise ValueError(
                    f"kind {i} ({m!r}) is relaxed by {kind}(), which takes its radius from "
                    f"a sharpness ball; the Hessian has none: pass eps={kind}(radius) or a "
                    "number"
                )
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("batches is empty: nothing to measure the Hessian on")
        self._advance: Callable[[], object] = lambda: None
        self._loss: BatchLoss | InPlaceLoss
        if product == "finite_difference":
            self._loss = InPlaceLoss(self.geometry, loss_fn, self.batches)
            points, w = self._loss.base()
            # no gradient is kept: each product takes the connection term's ∇f from its own
            # two gradients (InPlaceLoss.difference); ``gradient`` takes it when read
            self.loss = self._loss.value()
            self._gradient: list[Tensor] | None = None
        else:
            points, w = self.geometry.gather()
            self._loss = BatchLoss(self.geometry, loss_fn, self.batches)
            self.loss, self._gradient = self._loss.gradient(points, w)
        self._points, self._w = points, w
        if geometry == "euclidean":
            self.parts: list[Part] = [FlatPart() for _ in (*points, w)]
        else:
            rest_manifold = self.geometry.rest_manifold()
            if not isinstance(rest_manifold, AdaptiveGeometry):
                raise TypeError(
                    f"the adaptive rest must be an AdaptiveGeometry, got {rest_manifold!r}"
                )
            self.parts = [QuotientPart(x, m) for x, m in zip(points, manifolds, strict=True)]
            self.parts.append(FrozenPart(w, rest_manifold, self.geometry.compute_dtype))
        self._rest_sizes = list(self.geometry.plan.adaptive_sizes)
        #: The coordinates' dtype: the base point may keep the adaptive rest narrower
        #: (:attr:`~quotientgeo.curvature.inplace.InPlaceLoss.rest_dtype`).
        self.dtype = self.geometry.compute_dtype
        #: The dtypes whose rounding the finite difference meets (default step).
        self._dtypes = {self.dtype, *(p.dtype for p in self.geometry.params.values())}
        self._sizes = [t.numel() for t in (*points, w)]
        self._shapes = [t.shape for t in (*points, w)]
        n = sum(self._sizes)
        self.shape = (n, n)
        self.device = w.device
        self.products = 0
        #: ``step · s_p`` of the finite difference (:func:`_part_scales`), on the device.
        self._step_scales = torch.zeros(0, dtype=w.dtype, device=w.device)
        if product == "finite_difference":
            step = self._step if self._step is not None else default_step(*self._dtypes)
            self._step_scales = _part_scales(self._pieces([*points, w]), self.dtype).mul_(step)

    # ------------------------------------------------------------------ coordinates
    @functools.cached_property
    def groups(self) -> list[Group]:
        """The coordinates grouped by layer and kind of block
        (:mod:`quotientgeo.curvature.groups`), for :meth:`restricted`; built when first read
        (their indices take two copies of the parameters in ``int64``)."""
        return groups_of(self.geometry, self.device)

    @property
    def dim(self) -> int:
        """``D``: the number of trainable entries."""
        return self.shape[0]

    @property
    def passes(self) -> int:
        """Batch passes so far (the gradient at construction, then one per batch per
        product of a vector or a matrix)."""
        return self._loss.passes

    @property
    def gradient(self) -> Tensor:
        """``∇f`` at the weights, flat (Euclidean coordinates). The finite-difference operator
        keeps none of it: it takes the gradient (one pass per batch) when this is read."""
        if self._gradient is None:
            assert isinstance(self._loss, InPlaceLoss)  # the one that keeps no gradient
            _, (points, w) = self._loss.gradient(advance=self._advance)
            return self._join([*points, w])
        return self._join(self._gradient)

    def _split(self, v: Tensor) -> list[Tensor]:
        return [t.reshape(s) for t, s in zip(v.split(self._sizes), self._shapes, strict=True)]

    def _join(self, parts: list[Tensor]) -> Tensor:
        return torch.cat([t.reshape(-1) for t in parts])

    def _vector(self, v: Tensor, name: str) -> Tensor:
        if not isinstance(v, Tensor) or v.shape != (self.dim,):
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"{name} must be a tensor of shape ({self.dim},), got {got}")
        return v.to(dtype=self.dtype, device=self.device)

    def tangent(self, z: Tensor) -> Tensor:
        """``P^h T z``: the horizontal tangent vector of whitened coordinates ``z`` (flat)."""
        z = self._vector(z, "z")
        return self._join([p.tangent(t) for p, t in zip(self.parts, self._split(z), strict=True)])

    def whiten(self, xi: Tensor) -> Tensor:
        """``Tᵀ G ξ``: whitened coordinates of the tangent vector ``ξ`` (flat);
        ``tangent(whiten(ξ)) = ξ`` for a horizontal ``ξ``."""
        xi = self._vector(xi, "xi")
        return self._join([p.whiten(t) for p, t in zip(self.parts, self._split(xi), strict=True)])

    def inner(self, xi: Tensor, eta: Tensor) -> Tensor:
        """``⟨ξ, η⟩_x = ξᵀ G η`` of two tangent vectors (flat)."""
        xi, eta = self._vector(xi, "xi"), self._vector(eta, "eta")
        images = [p.metric(t) for p, t in zip(self.parts, self._split(eta), strict=True)]
        return torch.dot(xi, self._join(images))

    def to_parameters(self, v: Tensor) -> dict[str, Tensor]:
        """A vector in the operator's (tangent) coordinates as ``name -> tensor`` in the
        parameters' shapes (and dtypes)."""
        parts = self._split(self._vector(v, "v"))
        return self.geometry.scatter(parts[:-1], parts[-1])

    def restricted(self, group: Group) -> BlockOperator:
        """The diagonal block of this operator on ``group``'s coordinates."""
        return BlockOperator(self, group)

    # ------------------------------------------------------------------ products
    @overload
    def _difference(
        self, z: list[Tensor], xi: list[Tensor | None], into: None = None, beta: float = 0.0
    ) -> tuple[list[Tensor], list[Tensor | None]]: ...
    @overload
    def _difference(
        self, z: list[Tensor], xi: list[Tensor | None], into: list[Tensor] | None, beta: float
    ) -> tuple[list[Tensor | None], list[Tensor | None]]: ...
    def _difference(
        self,
        z: list[Tensor],
        xi: list[Tensor | None],
        into: list[Tensor] | None = None,
        beta: float = 0.0,
    ) -> tuple[list[Tensor] | list[Tensor | None], list[Tensor | None]]:
        """``(∇f(x + tξ) - ∇f(x - tξ)) / (2t) = ∇²f ξ + O(t²)`` (central difference) for the
        tangent vector ``ξ`` of whitened ``z``, and the gradient the connection term takes:
        ``(∇f(x + tξ) + ∇f(x - tξ)) / 2 = ∇f(x) + O(t²)``, the symmetry blocks' parts (``None``
        for the rest's, whose ``Γ`` is zero); ``xi`` holds its parts that are formed (the
        symmetry blocks'), ``None`` where a part forms ``x ± tξ`` from ``z`` itself (the
        element-wise ones, so that no vector of the adaptive rest's size is held). ``xi`` is
        emptied: a caller that holds no other reference lets the passes free the blocks' ``ξ``
        once the displaced weights are written. The step stays on the device:
        ``t = min_p (step · s_p / ‖ξ_p‖_∞)`` (:func:`_part_scales`; ``ξ = 0`` gives ``0``).
        With ``into`` (views of an output, per adaptive parameter) the rest's ``T``-image of
        the difference ``d`` is written there as ``into ← β · into + T d``, and its entry in
        the result is ``None``. The parts release their base point's factors before the passes
        (:meth:`~quotientgeo.curvature.parts.Part.release`): a caller forms them again after,
        inside :func:`~quotientgeo.linalg.deferred_checks` (one host read for their checks)."""
        # ξ's parts held only for the step (the rest's, formed here, freed before the passes)
        t = _step_of(
            self._pieces(
                [
                    p.tangent_into(zp, torch.empty_like(zp)) if v is None else v
                    for p, zp, v in zip(self.parts, z, xi, strict=True)
                ]
            ),
            self._step_scales,
        )

        assert isinstance(self._loss, InPlaceLoss)
        rest = self.parts[-1], z[-1] if xi[-1] is None else xi[-1]
        if xi[-1] is not None:  # ξ_w given (apply): displaced along it in the flat geometry
            rest = FlatPart(), xi[-1]
        points_xi = [
            p.tangent(zp) if v is None else v
            for p, zp, v in zip(self.parts[:-1], z, xi, strict=False)
        ]
        xi.clear()  # given up by the caller: the passes empty points_xi once written
        for part in self.parts:  # not held through the passes' peak: formed again after them
            part.release()
        points, w, gradient = self._loss.difference(
            self._w, points_xi, rest, t, self._advance, into, beta
        )
        return [*points, w], [*gradient, None]

    def _pieces(self, parts: list[Tensor]) -> list[Tensor]:
        """The parts of the finite difference's step: each kind of symmetry blocks, and each
        parameter's slice of the adaptive rest (views), those with entries."""
        *kinds, rest = parts
        return [t for t in (*kinds, *rest.split(self._rest_sizes)) if t.numel()]

    def _covectors(self, xis: list[list[Tensor]]) -> list[list[Tensor]]:
        """``(∇²f - c)(ξ)`` of tangent vectors ``ξ`` (lists of parts)."""
        assert isinstance(self._loss, BatchLoss)
        hv = self._loss.hvp(self._points, self._w, xis, advance=self._advance)
        assert self._gradient is not None  # kept by the double-backward operator
        return [self._connected(h, xi, self._gradient) for h, xi in zip(hv, xis, strict=True)]

    def _connected(
        self,
        hv: Sequence[_Part],
        xi: Sequence[Tensor | None],
        gradient: Sequence[Tensor | None],
    ) -> list[_Part]:
        """``∇²f ξ - c(ξ)`` from ``hv = ∇²f ξ`` and the parts' ``∇f`` (``c`` subtracted in
        place where it is not zero; ``None`` parts of ``hv``, streamed elsewhere, stay
        ``None``)."""
        out: list[_Part] = []
        for part, hp, xp, g in zip(self.parts, hv, xi, gradient, strict=True):
            c = None if xp is None else part.connection(xp, g)
            if c is not None and hp is not None:
                hp.sub_(c)
            out.append(hp)
        return out

    def apply(self, xi: Tensor) -> Tensor:
        """``Hess ξ = P^h G⁻¹ (∇²f - c) P^h ξ`` of a tangent vector ``ξ`` (flat): the
        Riemannian Hessian itself, self-adjoint in :meth:`inner`."""
        xi = self._vector(xi, "xi")
        parts = [p.project(t) for p, t in zip(self.parts, self._split(xi), strict=True)]
        with deferred_checks():  # the factors a finite difference released: one host read
            if self.product == "finite_difference":  # the tangent ξ itself: whitened by T = I
                hv, gradient = self._difference(parts, list(parts))
                covector = self._connected(hv, parts, gradient)
            else:
                (covector,) = self._covectors([parts])
            out = self._join([p.riemannian(c) for p, c in zip(self.parts, covector, strict=True)])
        self.products += 1
        return out

    def _matmat(self, Z: Tensor) -> Tensor:
        if self.product == "finite_difference":
            out = [self._finite_difference_column(col) for col in Z.unbind(1)]
            self.products += len(out)
            if not out:
                return Z.clone()
            return out[0].unsqueeze(1) if len(out) == 1 else torch.stack(out, dim=1)
        columns = Z.unbind(1)
        with torch.enable_grad():
            zs = [[t.detach().requires_grad_(True) for t in self._split(col)] for col in columns]
            xis = [[p.tangent(t) for p, t in zip(self.parts, z, strict=True)] for z in zs]
        covectors = self._covectors([[t.detach() for t in xi] for xi in xis])
        out = []
        for z, xi, c in zip(zs, xis, covectors, strict=True):
            back = torch.autograd.grad(xi, z, c, allow_unused=True)
            out.append(
                self._join(
                    [torch.zeros_like(t) if b is None else b for t, b in zip(z, back, strict=True)]
                )
            )
        self.products += len(columns)
        return torch.stack(out, dim=1) if out else Z.clone()

    def addmv_(self, out: Tensor, z: Tensor, *, beta: float) -> Tensor:
        """``out ← β · out + A z`` in place (``torch.addmv``'s ``beta``), returns ``out``.
        The finite-difference product forms ``A z`` in ``out`` itself: the rest's part
        straight from the gradients (:meth:`_finite_difference_column`), so that a Lanczos
        step ``A v_j - β_{j-1} v_{j-1}`` holds two vectors of the operator's size, not
        three."""
        if self.product != "finite_difference":
            return super().addmv_(out, z, beta=beta)
        self._check_out(out, z)
        self._finite_difference_column(z.to(dtype=self.dtype, device=self.device), out, beta)
        self.products += 1
        return out

    def _finite_difference_column(
        self, z: Tensor, out: Tensor | None = None, beta: float = 0.0
    ) -> Tensor:
        """``A z`` by the central difference (:meth:`_difference`), a new vector formed after
        the passes; or ``out ← β · out + A z`` into a given ``out`` (``β = 0`` overwrites it,
        whatever it holds). The symmetry blocks' tangent ``P^h T z`` is formed twice, without
        a graph for the displaced weights (freed before the second backward pass, the peak)
        and with its graph after the passes (its adjoint is its vector-Jacobian product; the
        values are the same), the element-wise parts' ``T`` applied where needed. Into a given
        ``out``, where the model's parameters allow
        (:attr:`~quotientgeo.curvature.inplace.InPlaceLoss.streams`), the rest's part goes
        into ``out`` from the gradients themselves, with no vector of its size besides; a new
        vector is not held through the passes (the rest's difference is gathered first)."""
        zs = self._split(z)
        outs = None if out is None else self._split(out)
        with torch.no_grad():
            formed = [
                None if p.symmetric else p.tangent(t) for p, t in zip(self.parts, zs, strict=True)
            ]
        into = None
        assert isinstance(self._loss, InPlaceLoss)
        if outs is not None and self._loss.streams:
            params = self.geometry.params
            into = [
                v.view(params[n].shape)
                for v, n in zip(
                    outs[-1].split(self._rest_sizes), self.geometry.plan.adaptive_names, strict=True
                )
            ]
        # the blocks' factors, released through the passes, are formed again in this block:
        # their checks in one host read
        with deferred_checks():
            hv, gradient = self._difference(zs, formed, into, beta)  # empties formed
            leaves: list[Tensor] = []
            xis: list[Tensor | None] = []
            with torch.enable_grad():
                for part, t in zip(self.parts, zs, strict=True):
                    leaf = t if part.symmetric else t.detach().requires_grad_(True)
                    leaves.append(leaf)
                    xis.append(None if part.symmetric else part.tangent(leaf))
            covector = self._connected(
                hv, [None if v is None else v.detach() for v in xis], gradient
            )
            del hv, gradient
            # the blocks' images (their vector-Jacobian products, with their graphs'
            # temporaries) before a new output is allocated: not both at once
            for i, (xi, leaf) in enumerate(zip(xis, leaves, strict=True)):
                if xi is not None and covector[i] is not None:
                    covector[i] = torch.autograd.grad(xi, leaf, covector[i])[0]
                    xis[i] = None
            if out is None:
                out = torch.empty_like(z)
                outs = self._split(out)
            assert outs is not None
            for part, c, o in zip(self.parts, covector, outs, strict=True):
                if c is None:  # streamed into out
                    continue
                if part.symmetric and beta == 0:
                    part.tangent_into(c, o)
                    continue
                image = part.tangent(c) if part.symmetric else c  # the blocks': formed above
                if beta == 0:
                    o.copy_(image)
                else:
                    o.mul_(beta).add_(image)
            return out

    def __repr__(self) -> str:
        model = type(self.geometry.model).__name__
        return (
            f"RiemannianHessian({model}, geometry={self.geometry_kind!r}, dim={self.dim}, "
            f"batches={len(self.batches)}, dtype={self.dtype})"
        )


def default_step(*dtypes: torch.dtype) -> float:
    """The finite difference's default relative step, ``ε^{1/3} / 8`` with ``ε`` the machine
    epsilon of the widest-spaced of ``dtypes`` (the coordinates' and the parameters'):
    ``6.1e-4`` in float32, ``7.6e-7`` in float64, ``2.5e-2`` for bfloat16 parameters.

    It balances the central difference's truncation ``M s²`` against the gradient's rounding
    ``c ε / s`` at ``s = (c ε / 2M)^{1/3}``: measured on random Llama decoders,
    ``c ≈ 2`` along random directions and ``M ≈ 10³`` along the top eigenvector (relative
    errors of ``A z``, ``examples/llama_fd_step.py --products``), whence the ``1/8``
    (``(c / 2M)^{1/3} = 0.1``, rounded to a power of two)."""
    eps = max(torch.finfo(d).eps for d in dtypes)
    return eps ** (1 / 3) / 8


def _part_scales(pieces: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The finite difference's scales ``s_p = max(‖x_p‖_∞, rms(x))`` of the pieces ``x_p``
    of the base point (each kind of symmetry blocks, each parameter of the adaptive rest), with
    ``rms(x)`` the root mean square of all their entries (the floor of a piece at zero, a bias
    at initialisation), in ``dtype``; on the device, never read on the host."""
    if not pieces:
        return torch.zeros(0, dtype=dtype)
    largest = torch.stack(torch._foreach_norm(pieces, ord=float("inf"), dtype=dtype))  # pyright: ignore[reportPrivateImportUsage]
    squares = torch.stack(torch._foreach_norm(pieces, dtype=dtype)).square().sum()  # pyright: ignore[reportPrivateImportUsage]
    rms = (squares / sum(t.numel() for t in pieces)).sqrt()
    return torch.maximum(largest, rms)


def _step_of(pieces: list[Tensor], step_scales: Tensor) -> Tensor:
    """``t = min_p (step · s_p / ‖ξ_p‖_∞)`` over the pieces of ``ξ``: the largest ``t`` that
    moves no piece by more than ``step`` of its scale (:func:`_part_scales`); a scalar tensor,
    unread (a finite ``t`` where ``ξ = 0``, which then moves nothing)."""
    if not pieces:
        return step_scales.new_zeros(())
    norms = torch.stack(torch._foreach_norm(pieces, ord=float("inf")))  # pyright: ignore[reportPrivateImportUsage]
    return torch.div(step_scales, norms.clamp_min_(torch.finfo(norms.dtype).tiny)).min()


class BlockOperator(_SymmetricOperator):
    """The diagonal block ``A_gg`` of a :class:`RiemannianHessian` on the coordinates of one
    group ``g``: ``z_g ↦ (A [z_g; 0])_g``, symmetric, of size ``group.dim``.

    Attributes:
        hessian: the whole operator.
        group: the :class:`~quotientgeo.curvature.groups.Group`.
    """

    def __init__(self, hessian: RiemannianHessian, group: Group):
        self.hessian = hessian
        self.group = group
        self.shape = (group.dim, group.dim)
        self.dtype = hessian.dtype
        self.device = hessian.device

    def _matmat(self, Z: Tensor) -> Tensor:
        full = Z.new_zeros(self.hessian.dim, Z.shape[1])
        full[self.group.index] = Z
        return self.hessian._matmat(full)[self.group.index]

    def __repr__(self) -> str:
        return f"BlockOperator({self.group.name!r}, dim={self.group.dim})"
