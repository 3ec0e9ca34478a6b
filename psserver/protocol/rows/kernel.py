"""Which table kernel runs: the C loops of ``_kernel.c`` where ``pip install -e .`` could build them, numpy's
otherwise (PyG's pattern: torch_geometric/typing.py).

The kernel is the per-id work of a table call: the id index's probe and insert (psserver.protocol.rows.index) and
the uniform initialiser's rows (psserver.protocol.rows.init).  Both give the same results bit for bit
(tests/unit/test_row_kernel.py runs each on the same inputs); the C loops do in one pass what numpy does in a
handful of whole-array passes per probe round -- docs/design/step-engine.md, "The table kernel", has what that is worth.
``PSGRPC_KERNEL=numpy`` in the environment selects numpy's even where the C loops exist (for a comparison, or to
rule the extension out).
"""

from __future__ import annotations

import os

try:
    if os.environ.get("PSGRPC_KERNEL", "").lower() == "numpy":
        raise ImportError("PSGRPC_KERNEL=numpy")
    from psserver.protocol.rows import _kernel as native
except ImportError:  # not built (no compiler at install), or turned off
    native = None


def name() -> str:
    """The kernel in use: "c" or "numpy" (in ps-server's startup line and its /stats)."""
    return "numpy" if native is None else "c"
