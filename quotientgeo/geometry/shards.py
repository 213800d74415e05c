"""Parameters sharded by ``torch.distributed`` (FSDP2's ``fully_shard``): their local part and
the whole.

FSDP2 keeps every parameter it manages as a ``DTensor``: each rank holds a part of it (rows of
dim 0 for the usual ``Shard(0)`` placement) and all-gathers the whole parameter only for the
forward and backward passes of its module. The maximiser and the optimizer keep their state as
optimizers do: one tensor per parameter, its local part, so that each rank holds ``1/world`` of
every parameter-sized buffer. A symmetry block (one layer's attention heads) is read whole:
:func:`full` all-gathers the parameters of the block, never of the whole model, and
:func:`local_part` takes this rank's part of a whole tensor again.

For a plain tensor every function here is the identity: nothing is gathered or copied.
"""

from __future__ import annotations

import sys

import torch

Tensor = torch.Tensor

__all__ = ["full", "is_sharded", "like", "local", "local_part", "reshard", "sharded_parameters"]


def _dtensor() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is loaded (a tensor can only be a
    ``DTensor`` then; importing it here would import much of ``torch.distributed``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_sharded(t: Tensor) -> bool:
    """Is ``t`` a ``DTensor`` (a parameter FSDP2 manages)?"""
    cls = _dtensor()
    return cls is not None and isinstance(t, cls)


def sharded_parameters(params) -> bool:
    """Does any of ``params`` live sharded over ranks?"""
    return any(is_sharded(p) for p in params)


def local(t: Tensor) -> Tensor:
    """The part of ``t`` on this rank (``t`` itself for a plain tensor), detached: in-place
    writes into it write into ``t``."""
    if is_sharded(t):
        return t.to_local().detach()  # pyright: ignore[reportAttributeAccessIssue]
    return t.detach()


def full(part: Tensor, like: Tensor) -> Tensor:
    """The whole tensor whose local part on this rank is ``part``, sharded as the parameter
    ``like`` (an all-gather over its device mesh; ``part`` itself when ``like`` is plain).

    Every rank of the mesh must call it, in the same order.
    """
    if not is_sharded(like):
        return part
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(
        part,
        like.device_mesh,  # pyright: ignore[reportAttributeAccessIssue]
        like.placements,  # pyright: ignore[reportAttributeAccessIssue]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
    return whole.full_tensor()


def local_part(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's part of ``whole`` (a tensor of ``like``'s global shape that every rank holds
    alike), sharded as the parameter ``like``; ``whole`` itself when ``like`` is plain. No
    communication."""
    if not is_sharded(like):
        return whole
    from torch.distributed.tensor import distribute_tensor

    part = distribute_tensor(
        whole.detach(),
        like.device_mesh,  # pyright: ignore[reportAttributeAccessIssue]
        like.placements,  # pyright: ignore[reportAttributeAccessIssue]
        src_data_rank=None,
    )
    return part.to_local()


def like(part: Tensor, param: Tensor) -> Tensor:
    """The local part ``part`` as a tensor sharded like ``param`` (a ``DTensor`` without
    communication), or ``part`` itself for a plain ``param``."""
    if not is_sharded(param):
        return part
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        part,
        param.device_mesh,  # pyright: ignore[reportAttributeAccessIssue]
        param.placements,  # pyright: ignore[reportAttributeAccessIssue]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def reshard(model: torch.nn.Module) -> None:
    """Free the whole parameters that FSDP2 keeps after a forward pass without backward (the
    root module keeps them by default), so that the next forward pass gathers the local parts
    anew, as they are written to, and the modules hold their sharded parameters again."""
    if "torch.distributed.fsdp" not in sys.modules:
        return  # nothing is sharded unless FSDP was imported
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
