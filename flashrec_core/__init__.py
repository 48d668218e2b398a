"""FlashRec core: the model-agnostic GenRec inference engine.

Importing this package must stay light (no torch): `flashrec_core.spec` and
`flashrec_core.registry` are used by tools that only list plugins.
"""

__version__ = "0.1.0"
