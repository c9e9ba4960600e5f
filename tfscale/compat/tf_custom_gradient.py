"""TensorFlow gap: a graph-mode `tf.custom_gradient` pins its whole graph for the process's life.

Each call of a `tf.custom_gradient` function while a graph is built (inside `tf.function`,
so in every Keras `fit`) registers its gradient function under a fresh name in
TensorFlow's global gradient registry (`ops._gradient_registry`) and never removes it.
That function closes over the forward tensors (TF 2.19 to 2.21 capture the whole `result`,
tensorflow/tensorflow#97697; a user's gradient function usually captures some too), and a
tensor holds its graph: every traced `train_function` stays in memory with all its nested
functions after its model is gone (tensorflow/tensorflow#27492). Plain Keras hits it on
one device: `TFOptimizer._all_reduce_sum_gradients` calls
`ReplicaContext.all_reduce`, a `custom_gradient`, in every traced train step; tfscale's
model split adds one per stage (`strategies/_placement.on_device`). Measured here
(tests/test_compat.py): 40 equivalence cases in one process left ~2,300 functions in the
eager context and 1.6 M Python objects, and every later garbage collection and trace paid
for them.

`release_with_graph()` makes the registry hold each such gradient function weakly and
the graph that holds the op strongly, and drops the registry entry when that graph is
freed. Nothing else changes: while the graph lives (it must, for any gradient of its ops
to be built) the gradient is found under the same name and computes the same thing.
Gate: applied where `custom_gradient._graph_mode_decorator` and the registry's private
dict exist (TF 2.12 to 2.21 checked); otherwise it does nothing and returns False.
FIXED_IN: none as of TF 2.21 (the open upstream fix stops capturing `result` only; the
entry and a gradient function's own captures stay).
"""

import threading
import weakref

__all__ = ["CHECKED_ON", "FIXED_IN", "release_with_graph"]

CHECKED_ON = ("2.12", "2.21")
FIXED_IN = None
_PREFIX = "CustomGradient-"
_COLLECTION = "_tfscale_custom_gradients"
_lock = threading.Lock()


def release_with_graph():
    """Ties each graph-mode custom gradient's registry entry to its graph; False where unsupported."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import custom_gradient
    except ImportError:
        return False
    original = getattr(custom_gradient, "_graph_mode_decorator", None)
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    if not callable(original) or not isinstance(registry, dict):
        return False
    if getattr(original, "_tfscale_released", False):
        return True
    with _lock:
        if not getattr(custom_gradient._graph_mode_decorator, "_tfscale_released", False):
            custom_gradient._graph_mode_decorator = _released(original, registry, ops)
    return True


def _released(original, registry, ops):
    def graph_mode_decorator(f, args, kwargs):
        before = set(registry)
        result = original(f, args, kwargs)
        graph = ops.get_default_graph()
        for name in set(registry) - before:
            entry = registry[name]
            if name.startswith(_PREFIX) and not getattr(entry.get("type"), "_tfscale_weak", False):
                _hold(graph, name, entry, registry)
        return result

    graph_mode_decorator._tfscale_released = True
    graph_mode_decorator.__wrapped__ = original
    return graph_mode_decorator


def _hold(graph, name, entry, registry):
    function = entry["type"]
    # The graph keeps it alive, not the registry (a graph has no __dict__; a collection is
    # the graph's own storage, and it goes with the graph).
    graph.add_to_collection(_COLLECTION, function)
    entry["type"] = _weak(function, name)
    weakref.finalize(graph, registry.pop, name, None)


def _weak(function, name):
    ref = weakref.ref(function)

    def gradient(op, *grads):
        live = ref()
        if live is None:  # its graph, and so the op, is gone: nothing can ask for it
            raise LookupError(f"custom gradient {name} was asked for after its graph was freed")
        return live(op, *grads)

    gradient._tfscale_weak = True
    return gradient
