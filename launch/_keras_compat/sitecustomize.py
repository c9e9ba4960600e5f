"""Applies tfscale's Keras 3 fixes for Mirrored/MWMS in programs that do not know about tfscale.

`tfscale-launch --keras_compat` puts this folder first on the tasks'
`PYTHONPATH`. Python imports `sitecustomize` at start-up (unless run with
`-S` or `-I`); this one installs an import hook and nothing else: when the
program (or TensorFlow, for `tf.keras`) imports `keras`, the hook calls
`tfscale.compat.apply_strategy_fixes()` right after Keras has loaded: the same
set `tfscale.strategies.get("mirrored" | "multi_worker")` applies (`fit` works
under MWMS, clipping after the all-reduce, mean losses over the global batch,
and the rest; tfscale/compat/__init__.py). So the TensorFlow tutorial's
`main.py` that builds its own `tf.distribute.MultiWorkerMirroredStrategy()` can
`fit` unchanged, with plain Keras's one-device numbers. Programs that never
import Keras are untouched. A `sitecustomize` further down `sys.path` (a
distribution's own) still runs.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

__all__ = []

_HERE = os.path.dirname(os.path.abspath(__file__))


class _ApplyAfterLoad(importlib.abc.Loader):
    """Wraps Keras' loader: runs it, then applies the fixes."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            from tfscale.compat import apply_strategy_fixes

            apply_strategy_fixes()
        except Exception as e:  # never break the user's program from a shim
            print(f"tfscale-launch --keras_compat: could not apply the Keras fixes: {e!r}", file=sys.stderr)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _KerasHook(importlib.abc.MetaPathFinder):
    """Hands out Keras' spec with the wrapped loader.

    Stays on `sys.meta_path`: `find_spec("keras")` is also called without an
    import (TensorFlow's `tf.keras` set-up does), and once Keras is in
    `sys.modules` the import system no longer asks.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ApplyAfterLoad(spec.loader)
        return spec


def _run_next_sitecustomize():
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if "keras" not in sys.modules:
    sys.meta_path.insert(0, _KerasHook())
_run_next_sitecustomize()
