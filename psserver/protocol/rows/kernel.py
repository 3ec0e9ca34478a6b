"""Which table kernel runs: the C loops of ``_kernel.c`` where ``pip install -e .`` could build them, numpy's
otherwise (PyG's pattern: torch_geometric/typing.py).

The kernel is the per-id work of a table call: the id index's probe and insert (psserver.protocol.rows.index), the
uniform initialiser's rows (psserver.protocol.rows.init), a lookup's and a push's bookkeeping in one loop each
(psserver.protocol.rows.space, the fused calls) and packed ids (psserver.protocol.rows.idpack).  Both give the
same results bit for bit (tests/unit/test_row_kernel.py runs each on the same inputs); the C loops do in one pass
what numpy and torch do in a handful of whole-array calls -- docs/design/step-engine.md, "The table kernel", has
what that is worth.
``PSGRPC_KERNEL=numpy`` in the environment selects numpy's even where the C loops exist (for a comparison, or to
rule the extension out).
"""

from __future__ import annotations

import os

try:
    if os.environ.get("PSGRPC_KERNEL", "").lower() == "numpy":
        raise ImportError("PSGRPC_KERNEL=numpy")
    from psserver.protocol.rows import _kernel as native
    if not all(hasattr(native, f) for f in ("lookup_rows", "gather_rows", "scatter_rows", "pack_ids", "unpack_ids")):
        raise ImportError("built from an older _kernel.c: pip install -e . again")  # (numpy's path meanwhile)
except ImportError:  # not built (no compiler at install), or turned off
    native = None


def name() -> str:
    """The kernel in use: "c" or "numpy" (in ps-server's startup line and its /stats)."""
    return "numpy" if native is None else "c"
