"""The parameter geometry of a model: symmetry blocks, their layout, gather/scatter, discovery.

- :mod:`.layout`: :class:`Source` regions of parameters and their coverage;
- :mod:`.plan`: the frozen plan (blocks, kinds, reassembly of parameters);
- :mod:`.transfer`: gather points from parameters and scatter them back;
- :mod:`.parameters`: :class:`ParameterGeometry`, the declarations;
- :mod:`.discovery`: :func:`find_symmetries` for attention and LoRA layers, and
  :func:`register_reader` to teach it a new attention layout;
- :mod:`.symmetries`: the geometry a measure or the optimizer uses, its manifolds resolved;
- :mod:`.shards`: local parts of FSDP2-sharded parameters;
- :mod:`.perturbation`: the tangent spaces at a base point, a chunk of blocks at a time;
- :mod:`.diagnosis`: which block, layer and head a failure of the geometry comes from.
"""

from .discovery import (
    ROTARY_PAIRING,
    AttentionFinding,
    DiscoveryContext,
    ReaderHandle,
    Rotary,
    Unmapped,
    find_symmetries,
    register_reader,
)
from .layout import Region, Source
from .parameters import HALF, ParameterGeometry
from .plan import Block, HeadLocation, Kind

__all__ = [
    "HALF",
    "ROTARY_PAIRING",
    "AttentionFinding",
    "Block",
    "DiscoveryContext",
    "HeadLocation",
    "Kind",
    "ParameterGeometry",
    "ReaderHandle",
    "Region",
    "Rotary",
    "Source",
    "Unmapped",
    "find_symmetries",
    "register_reader",
]
