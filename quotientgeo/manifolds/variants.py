"""Families of metric variants: one quotient class per metric, chosen at construction.

``GLQuotient(n, metric)``, ``GLTotalSpace(n, metric)`` and ``RescaleQuotient(metric)`` construct
the class registered for ``metric`` (:class:`MetricVariants`), ``DEFAULT_METRIC`` when none
is named.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar, TypeVar, cast

from ..validation import is_real

#: The metric of every shipped quotient whose metric is a choice (GL pairs, their rotary
#: subgroup, re-scaling pairs) when none is named, in the manifolds, in
#: :meth:`~quotientgeo.ParameterGeometry.add_gl_pair` and in
#: :func:`~quotientgeo.find_symmetries`.
DEFAULT_METRIC = "mix"
T = TypeVar("T")

__all__ = ["DEFAULT_METRIC", "MetricVariants"]


class MetricVariants:
    """A family of quotient classes, one per metric, among which construction chooses.

    The family's root is declared with the class keyword ``variants=True``, each member with
    ``metric=name`` (a string, which also sets the member's ``metric_name``)
    or ``metric=float`` (the member for a real interpolation weight ``s``, which sets
    ``metric_name`` itself). ``Root(..., metric=m)`` (``metric`` as its ``__init__`` names it,
    by position or keyword) constructs the member registered under ``m``, ``DEFAULT_METRIC``
    when ``m`` is ``None`` or not given; a member checks with :meth:`_check_metric` that it was
    not asked for another metric. A class may be the root of one family and a member of
    another's (``GLQuotient`` is the root of the GL quotients and a subclass of the total
    spaces' root ``GLTotalSpace``); a member registers with the nearest root in its method
    resolution order.
    """

    _metric_variants: ClassVar[dict[object, type]]

    def __init_subclass__(
        cls, *, variants: bool = False, metric: str | type[float] | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if variants:
            cls._metric_variants = {}
        if metric is None:
            return
        if metric is not float and not isinstance(metric, str):
            raise TypeError(f"metric= must be a metric's name or float, got {metric!r}")
        registry = cls._metric_root()._metric_variants
        if metric in registry:
            raise TypeError(f"{cls.__name__}: {registry[metric].__name__} has metric {metric!r}")
        registry[metric] = cls
        if isinstance(metric, str):
            cls.metric_name = metric  # pyright: ignore[reportAttributeAccessIssue]

    @classmethod
    def _metric_root(cls) -> type[MetricVariants]:
        """The nearest class of the method resolution order that is a family's root."""
        for klass in cls.__mro__:
            if "_metric_variants" in vars(klass):
                return klass
        raise TypeError(f"{cls.__name__} belongs to no family of metric variants")

    @classmethod
    def metric_class(cls: type[T], metric: str | float | None = None) -> type[T]:
        """The member of this class's family for ``metric`` (``None``: ``DEFAULT_METRIC``)."""
        root = cast("type[MetricVariants]", cls)._metric_root()
        variants = root._metric_variants
        key = DEFAULT_METRIC if metric is None else metric
        found = variants.get(key) if isinstance(key, str) else None
        if found is None and is_real(key):
            found = variants.get(float)
        if found is None:
            names = [repr(name) for name in sorted(k for k in variants if isinstance(k, str))]
            if float in variants:
                names.append("a number s in [0, 1]")
            choices = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
            message = f"metric must be {choices}, got {metric!r}"
            if is_real(key):
                message += ": the interpolated metric s is defined for GL pairs only"
            raise ValueError(message)
        return found

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_metric_variants" in vars(cls):  # a family's root: construct the metric's member
            cls = cls.metric_class(_metric_argument(cls, args, kwargs))
        return super().__new__(cls)

    def _check_metric(self, metric: str | float | None) -> None:
        """Raise a ``ValueError`` unless this object is of the class of ``metric`` (if given)."""
        if metric is not None and not isinstance(self, type(self).metric_class(metric)):
            raise ValueError(f"{type(self).__name__} does not have the metric {metric!r}")


@functools.cache
def _init_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.__init__)


def _metric_argument(cls: type, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``metric`` argument of ``cls(*args, **kwargs)`` (``None`` when absent or when the
    arguments do not fit: ``__init__`` then raises its own error)."""
    try:
        bound = _init_signature(cls).bind(None, *args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("metric")
