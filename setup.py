"""kvrouter's three C extensions; everything else is in pyproject.toml.

* `kvrouter._blocktable`: the prefix index's tables (kvrouter/blocktable.py);
* `kvrouter._blockkeys`: chained block keys, XXH3-64 over the token words (kvrouter/blocks.py), with the official
  xxHash header vendored in kvrouter/_vendor/xxhash;
* `kvrouter._costfit`: kv_aware's cost refit (kvrouter/routing/calibration.py), bit for bit the Python fit, so it
  is compiled without floating-point contraction (no fused multiply-add) and never with fast-math.

All three are optional: without a C compiler the install still succeeds and kvrouter runs their pure-Python twins
(the router logs a warning). They are declared here, not under pyproject's `[tool.setuptools]`, where extension
modules are still marked experimental.
"""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11"]
EXACT_FLOAT_FLAGS = [*FLAGS, "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension("kvrouter._blocktable", ["kvrouter/_blocktable.c"], extra_compile_args=FLAGS, optional=True),
        Extension(
            "kvrouter._blockkeys",
            ["kvrouter/_blockkeys.c"],
            depends=["kvrouter/_vendor/xxhash/xxhash.h"],
            extra_compile_args=FLAGS,
            optional=True,
        ),
        Extension(
            "kvrouter._costfit", ["kvrouter/_costfit.c"], extra_compile_args=EXACT_FLOAT_FLAGS, optional=True
        ),
    ]
)
