"""The optional C table kernel (psserver/protocol/rows/_kernel.c); everything else is in pyproject.toml.

``optional=True``: where no compiler exists the install goes on without it and the numpy path is used
(psserver.protocol.rows.kernel says which one runs).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("psserver.protocol.rows._kernel", ["psserver/protocol/rows/_kernel.c"],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True)])
