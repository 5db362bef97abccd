"""Build of the one compiled part: the twin of the fan-out fast path.

Everything else is in pyproject.toml. The extension is optional: without a C
compiler the install still succeeds and the server runs the pure-Python
reference (and says so when it starts; see broky/server/fastpath.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "broky.server._feedscan",
            ["broky/server/_feedscan.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
