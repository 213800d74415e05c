"""One way to build a quotient: a total space with a metric and a group, composed.

Every shipped quotient holds its total space and its group as attributes (not as base
classes), a metric's class is chosen in ``__new__``, and no manifold class has more than six
classes in its method resolution order below ``torch.nn.Module``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import quotientgeo.manifolds as manifolds
from quotientgeo.manifolds import (
    GLGroup,
    GLInvQuotient,
    GLMixQuotient,
    GLQuotient,
    GLTotalSpace,
    InterpolatedGLQuotient,
    InterpolatedTotalSpace,
    InvTotalSpace,
    MixTotalSpace,
    ProductGroup,
    ProductQuotient,
    ProductTotalSpace,
    Quotient,
    QuotientManifold,
    RescaleGroup,
    RescaleInvQuotient,
    RescaleInvTotalSpace,
    RescaleMixQuotient,
    RescaleMixTotalSpace,
    RescaleQuotient,
    RotaryGLQuotient,
    RotaryGroup,
    ScaleGroup,
    ScaleQuotient,
    ScaleTotalSpace,
)

MAX_MRO = 6


def below_module(cls: type) -> list[type]:
    """The classes of ``cls.__mro__`` before ``torch.nn.Module``."""
    mro = cls.__mro__
    return list(mro[: mro.index(torch.nn.Module)])


PUBLIC = sorted(
    (
        cls
        for name in manifolds.__all__
        if isinstance(cls := getattr(manifolds, name), type) and issubclass(cls, torch.nn.Module)
    ),
    key=lambda cls: cls.__name__,
)


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda cls: cls.__name__)
def test_no_manifold_class_has_more_than_six_classes_below_module(cls):
    assert len(below_module(cls)) <= MAX_MRO, [c.__name__ for c in below_module(cls)]


def test_the_mro_of_the_gl_inv_quotient():
    names = [c.__name__ for c in below_module(GLInvQuotient)]
    assert names == ["GLInvQuotient", "GLQuotient", "Quotient", "QuotientManifold", "Manifold"]


SHIPPED = {
    "gl-inv": (lambda: GLQuotient(5, "inv"), GLInvQuotient, InvTotalSpace, GLGroup),
    "gl-mix": (lambda: GLQuotient(5), GLMixQuotient, MixTotalSpace, GLGroup),
    "gl-s": (lambda: GLQuotient(5, 0.3), InterpolatedGLQuotient, InterpolatedTotalSpace, GLGroup),
    "rotary": (lambda: RotaryGLQuotient(5, "inv"), RotaryGLQuotient, InvTotalSpace, RotaryGroup),
    "rescale-inv": (
        lambda: RescaleQuotient("inv"),
        RescaleInvQuotient,
        RescaleInvTotalSpace,
        RescaleGroup,
    ),
    "rescale-mix": (
        lambda: RescaleQuotient(),
        RescaleMixQuotient,
        RescaleMixTotalSpace,
        RescaleGroup,
    ),
    "scale": (lambda: ScaleQuotient(2), ScaleQuotient, ScaleTotalSpace, ScaleGroup),
    "product": (
        lambda: ProductQuotient(
            [
                (ScaleQuotient(1), torch.tensor([[0, 1, 2, 3]])),
                (RescaleQuotient("inv"), torch.tensor([[2, 3], [4, 5]])),
            ]
        ),
        ProductQuotient,
        ProductTotalSpace,
        ProductGroup,
    ),
}


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_every_shipped_quotient_composes_a_total_space_and_a_group(kind):
    build, cls, total_cls, group_cls = SHIPPED[kind]
    m = build()
    assert type(m) is cls and isinstance(m, Quotient)
    assert type(m.total) is total_cls and isinstance(m.group, group_cls)
    # composed, not inherited: neither part is a base class of the quotient
    assert not isinstance(m, (total_cls, group_cls))
    shapes = {"gl": (2, 9, 2), "rotary": (2, 9, 2), "product": (3, 6)}
    shape = shapes.get(kind.split("-")[0], (3, 2, 4))
    p = m.at(m.random(*shape, dtype=torch.float64))
    # the quotient and its total space share one point cache; the total space has no group
    assert p.manifold is m.total and m.total.lie_shape(p) == (0,)
    assert m.metric_name == m.total.metric_name
    # copies and pickles keep the class and the parts
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(other) is cls and repr(other) == repr(m)
        if kind != "product":  # a product's key is its identity
            assert other.geometry_key()[1:] == m.geometry_key()[1:]


def test_rotary_and_gl_share_one_total_space():
    rotary = RotaryGLQuotient(5, "mix", rotary_dims=2)
    assert rotary.total is rotary.gl.total
    x = rotary.origin(9, 4, dtype=torch.float64)
    assert rotary.at(x).manifold is rotary.gl.at(x).manifold


@pytest.mark.parametrize(
    ("family", "metric", "cls"),
    [
        (GLQuotient, "inv", GLInvQuotient),
        (GLQuotient, None, GLMixQuotient),
        (GLQuotient, 0.25, InterpolatedGLQuotient),
        (GLTotalSpace, "inv", InvTotalSpace),
        (GLTotalSpace, None, MixTotalSpace),
        (GLTotalSpace, 0.25, InterpolatedTotalSpace),
    ],
)
def test_the_metric_chooses_the_class(family, metric, cls):
    named = {} if metric is None else {"metric": metric}
    for m in (family(4, metric), family(4, **named), family(n=4, **named)):
        assert type(m) is cls
    assert type(cls(4)) is cls


def test_rescale_metric_chooses_the_class():
    assert type(RescaleQuotient("inv")) is RescaleInvQuotient
    assert type(RescaleQuotient(metric="mix")) is RescaleMixQuotient
    assert type(RescaleInvQuotient()) is RescaleInvQuotient
    with pytest.raises(ValueError, match=r"metric must be 'inv' or 'mix', got 0\.5: the interp"):
        RescaleQuotient(0.5)


def test_a_class_refuses_another_metric():
    with pytest.raises(ValueError, match="GLInvQuotient does not have the metric 'mix'"):
        GLInvQuotient(4, "mix")
    with pytest.raises(ValueError, match=r"InvTotalSpace does not have the metric 0\.5"):
        InvTotalSpace(4, 0.5)
    with pytest.raises(ValueError, match="RescaleMixQuotient does not have the metric 'inv'"):
        RescaleMixQuotient("inv")
    with pytest.raises(ValueError, match=r"metric must be 'inv', 'mix' or a number s in \[0, 1\]"):
        GLQuotient(4, "euclid")


def test_a_user_subclass_of_a_metric_class_keeps_its_class():
    class Mine(GLMixQuotient):
        pass

    assert type(Mine(4)) is Mine and type(Mine(4, "mix")) is Mine
    with pytest.raises(ValueError, match="Mine does not have the metric 'inv'"):
        Mine(4, "inv")
    assert isinstance(Mine(4), QuotientManifold)
