"""Process-level helpers both programs' command lines share: argument parsing from flags and the environment
(``cli_support``), log lines safe to print and count (``logsafe``), TensorBoard scalars (``tboard``).

Rule of this room: it imports nothing from the rest of ``psserver`` and nothing from ``trainer``.
"""
