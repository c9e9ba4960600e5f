"""Keras 3 gap: an optimizer's state cannot all be found by variable name.

`strategy.merge(model)` (and `save` of a split model, which saves the merged one) copies
a trained split model's optimizer state into a new optimizer built for the unsplit model.
Slots made by `add_variable_from_reference` carry their model variable's path in their
name ("dense_kernel_momentum") and are matched by it. Two kinds of state are not:

- per-variable lists indexed by the optimizer's private `_get_variable_index(variable)`:
  Adafactor's factored slots `_r`, `_c` and `_v` are named after the variable alone
  ("kernel"), so by name every layer's would take one layer's value (measured: `fit` after
  a merge or a `load_model` of a saved split model, loss 3.5e-4 off plain Keras);
- variables held as attributes whose names match nothing: Nadam's `_u_product` is an
  unnamed `Variable` ("variable_3", a counter that differs between two optimizers), and a
  LossScaleOptimizer's own `iteration` bears its inner optimizer's name (Nadam: loss 6e-4
  off when unmatched).

Public Keras has no way to ask an optimizer "the state of this variable" (its `variables`
is a flat list), so these pairs are found through the private index and the instance's
attributes, here and nowhere else.

Checked on Keras 3.15.1. Gate: `supported(optimizer)`: Keras 3 with `_get_variable_index`;
otherwise no pair is given and only the name matches are copied.
tests/test_compat_keras_optimizer.py fails when Adafactor's lists stop following the index.
FIXED_IN: none as of Keras 3.15.
"""

import keras

__all__ = ["attribute_pairs", "indexed_pairs", "supported"]

CHECKED_ON = ("3.15.1", "3.15.1")
# Lists the optimizer keeps that are not one entry per optimized variable: `_variables` is
# all of its own (iterations, learning rate, then the slots), and read at a variable's index
# it paired one variable's state with another's whenever the two models' variable orders
# differed (a layer frozen before the merge) and the shapes agreed.
_NOT_PER_VARIABLE = ("_variables", "_trainable_variables")
FIXED_IN = None


def supported(optimizer):
    """True where the optimizer keeps per-variable state behind `_get_variable_index`."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return keras.__version__.startswith("3.") and callable(getattr(inner, "_get_variable_index", None))


def indexed_pairs(source, target, theirs, mine):
    """(target's variable, source's variable) for each per-variable list entry of `mine` / `theirs`.

    `theirs` is a model variable `source` optimizes, `mine` the one `target` does; every list
    attribute of the (inner) optimizer with one entry per optimized variable is read at each
    one's index, and a pair is given where both entries are variables of one shape.
    """
    source = getattr(source, "inner_optimizer", source)
    target = getattr(target, "inner_optimizer", target)
    if not (supported(source) and supported(target)):
        return
    try:
        i, j = source._get_variable_index(theirs), target._get_variable_index(mine)
    except (AttributeError, KeyError):  # not optimized by it (e.g. frozen when it was built)
        return
    mine_count, their_count = len(target._trainable_variables), len(source._trainable_variables)
    for name, slots in vars(target).items():
        found = vars(source).get(name)
        if name in _NOT_PER_VARIABLE or not (isinstance(slots, list) and isinstance(found, list)):
            continue
        if len(slots) == mine_count and len(found) == their_count and _same_kind(slots[j], found[i]):
            yield slots[j], found[i]


def attribute_pairs(source, target):
    """(target's variable, source's variable) for each variable both hold under one attribute name,
    the inner optimizers' of a LossScaleOptimizer too."""
    for name, variable in vars(target).items():
        found = vars(source).get(name)
        if _same_kind(variable, found):
            yield variable, found
    inner, source_inner = getattr(target, "inner_optimizer", None), getattr(source, "inner_optimizer", None)
    if inner is not None and source_inner is not None:
        yield from attribute_pairs(source_inner, inner)


def _same_kind(a, b):
    return (
        isinstance(a, keras.Variable) and isinstance(b, keras.Variable) and tuple(a.shape) == tuple(b.shape)
    )
