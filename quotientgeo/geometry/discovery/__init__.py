"""Discovery of the symmetry blocks of attention and LoRA layers in a model.

- :mod:`.findings`: :class:`AttentionFinding` (what a reader found in one attention module),
  :class:`Rotary`, :class:`Unmapped`, the ``ROTARY_PAIRING`` table;
- :mod:`.context`: :class:`DiscoveryContext`, what readers may read besides their module;
- :mod:`.readers`, :mod:`.families`: one reader per attention layout;
- :mod:`.registry`: the readers tried, in order, and :func:`register_reader`;
- :mod:`.rules`: the one declaration rule, from a finding to blocks;
- :mod:`.walk`: :func:`find_symmetries`.

Whatever cannot be mapped exactly is left to the adaptive geometry with one warning that
names the module and the reason; attention-like modules that no reader recognises are
reported too, and attention blocks left out because frozen are counted in one warning.
"""

from .context import DiscoveryContext, Reader
from .findings import ROTARY_PAIRING, AttentionFinding, Rotary, Unmapped
from .registry import ReaderHandle, register_reader, registered_readers
from .walk import find_symmetries

__all__ = [
    "ROTARY_PAIRING",
    "AttentionFinding",
    "DiscoveryContext",
    "Reader",
    "ReaderHandle",
    "Rotary",
    "Unmapped",
    "find_symmetries",
    "register_reader",
    "registered_readers",
]
