"""tfscale: scale TensorFlow + Keras 3 training from one device to a cluster.

`import tfscale` is cheap: TensorFlow is imported only when a submodule that
needs it (`tfscale.strategies`, `tfscale.callbacks`, ...) is first used, so
command-line tools such as `tfscale-tfconfig` start instantly.
"""

import importlib

from tfscale.errors import Error

__version__ = "0.1.0"

__all__ = [
    "Error",
    "TfscaleWarning",
    "__version__",
    "callbacks",
    "cluster",
    "compat",
    "datasets",
    "launch",
    "strategies",
]

_SUBMODULES = frozenset(
    ["callbacks", "cluster", "compat", "datasets", "errors", "flags", "launch", "strategies"]
)


class TfscaleWarning(UserWarning):
    """Warnings issued by tfscale itself (tests turn them into errors)."""


def __getattr__(name):
    # PEP 562 lazy submodules: `tfscale.strategies.get(...)` works after a
    # plain `import tfscale` without every CLI paying TensorFlow's import.
    if name in _SUBMODULES:
        return importlib.import_module(f"tfscale.{name}")
    raise AttributeError(f"module 'tfscale' has no attribute {name!r}")
