"""An optimizer's weight-decay exclusions carried to a copy of it (Keras 3).

Upstream gap: `BaseOptimizer.exclude_from_weight_decay(var_list, var_names)` keeps what it
was told only in private attributes (`_exclude_from_weight_decay`, a set of the variables'
`_var_key`s, and `_exclude_from_weight_decay_pattern`, the compiled names), and neither
`get_config()` nor any public getter returns them. A copy made with
`from_config(get_config())` -- what a data-parallel replica's optimizer is -- therefore
decays every variable. Here the two attributes are read and the copy is told the same
thing through the public `exclude_from_weight_decay`, the excluded variables mapped to
the copy's own.

Checked on Keras 3.15.1 (the same attributes since Keras 3.0). Tested by
`tests/test_data_parallel_keras_equivalence.py` (`test_weight_decay_exclusions_are_read`
fails when the attributes move).
"""

__all__ = ["copy_exclusions", "exclusions"]


def exclusions(optimizer):
    """(excluded variables' `_var_key`s, the names' pattern string or None) of `optimizer`."""
    ids = set(getattr(optimizer, "_exclude_from_weight_decay", None) or ())
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    return ids, None if pattern is None else pattern.pattern


def copy_exclusions(source, target, pairs):
    """Tells unbuilt `target` what `source` excludes from weight decay.

    Args:
        source: the optimizer told (`exclude_from_weight_decay`).
        target: its unbuilt copy.
        pairs: (a variable of `source`'s model, the copy's variable it stands for).
    """
    ids, pattern = exclusions(source)
    if not ids and pattern is None:
        return
    # Keys as the optimizer makes them (`_var_key`: the TF backend's is path and id).
    var_list = [copy for variable, copy in pairs if source._var_key(variable) in ids]
    target.exclude_from_weight_decay(
        var_list=var_list or None, var_names=None if pattern is None else [pattern]
    )
