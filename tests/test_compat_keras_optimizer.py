"""tfscale.compat.keras_optimizer: optimizer options under data parallelism mean what they mean on one device.

Every run is compared with the single-device run with the same global batch. The
2-process multi-worker cluster is tested once, over several options, in
`test_multi_worker_optimizer_options_match_one_device`.
"""

import functools

import _optimizer_workers as workers
import keras
import numpy as np
import pytest
import tensorflow as tf
from _compat_gate import version_gate_test

from tfscale.compat import keras_optimizer
from tfscale.strategies import get

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_mirrored_matches_one_device": 1,
    "test_mixed_float16_loss_scaling_matches_one_device": 1,
    "test_mirrored_nadam_matches_one_device": 0,  # 12 s; Nadam under mirrored: test_equivalence
}


@functools.cache
def _reference(option, optimizer="adam", mixed=False):
    return _train("one_device", option, optimizer=optimizer, mixed=mixed)


def _train(name, option, optimizer="adam", mixed=False, **strategy_options):
    strategy = get(name, device="/cpu:0") if name == "one_device" else get(name, **strategy_options)
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    try:
        return workers.train(strategy, option, optimizer=optimizer)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _max_difference(got, want):
    return max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))


test_fix_is_version_gated = version_gate_test(keras_optimizer)


# Every option on 2 replicas in the fast tier; 4 replicas (the same code path) in the full run.
@pytest.mark.parametrize("replicas", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("option", sorted(workers.OPTIONS))
def test_mirrored_matches_one_device(option, replicas):
    got = _train("mirrored", option, cpu_replicas=replicas)
    # fp32 with the same global batch: only the order of additions differs.
    assert _max_difference(got, _reference(option)) < 1e-6


@pytest.mark.parametrize("option", ["accumulation", "accumulation_clip"])
def test_one_replica_mirrored_accumulates_like_one_device(option):
    # Keras's own path crashes here too (a 1-worker job, an elastic job shrunk to one).
    got = _train("mirrored", option, cpu_replicas=1)
    assert _max_difference(got, _reference(option)) < 1e-6


@pytest.mark.parametrize("option", ["plain", "global_clipnorm", "accumulation"])
def test_mixed_float16_loss_scaling_matches_one_device(option):
    # mixed_float16 computes activations and gradients in fp16 (11-bit mantissa,
    # relative rounding 4.9e-4) on a different batch split per replica, so the runs
    # round differently; SGD keeps that round-off proportional (Adam divides it by
    # tiny second moments). 16 steps at lr 0.05 stay within 2e-3.
    got = _train("mirrored", option, optimizer="sgd", mixed=True, cpu_replicas=2)
    assert _max_difference(got, _reference(option, optimizer="sgd", mixed=True)) < 2e-3


# Nadam advances `_u_product` in its `_backend_update_step` override before `super()`;
# the fix once called `update_step` directly, left it at 1.0 and divided by 1 - 1.0 (NaN).
# The plain, accumulating (update every k-th step, in a cond), EMA-overwrite and ZeRO
# stage 2 (sharded update) paths each reach the override.
@pytest.mark.parametrize(
    ("option", "zero_stage"), [("plain", 0), ("accumulation", 0), ("ema", 0), ("accumulation", 2)]
)
def test_mirrored_nadam_matches_one_device(option, zero_stage):
    got = _train("mirrored", option, optimizer="nadam", cpu_replicas=2, zero_stage=zero_stage)
    assert _max_difference(got, _reference(option, optimizer="nadam")) < 1e-6


def test_hand_built_strategy_needs_one_explicit_call():
    import tfscale.compat
    import tfscale.strategies

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert tfscale.compat.apply_optimizer_fixes() is True
    tfscale.strategies.configure_communication(strategy, bytes_per_pack=64)
    got = workers.train(strategy, "global_clipnorm")
    assert _max_difference(got, _reference("global_clipnorm")) < 1e-6


def _train_stock(option):
    strategy = get("mirrored", cpu_replicas=2)  # Applies the fix; undone for this run.
    keras_optimizer._unapply()
    try:
        return workers.train(strategy, option)
    finally:
        keras_optimizer.apply()


def _train_one_replica_overflows(strategy, stock=False):
    # Examples 8..15 (replica 1's half of the first batch) are 300x larger: under the
    # initial loss scale 2**15 their fp16 gradients overflow, replica 0's do not.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    x[8:16] *= 300
    y = rng.normal(size=(64, 1)).astype("float32")
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential(
                [keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")]
            )
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        if stock:
            keras_optimizer._unapply()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    finally:
        keras_optimizer.apply()
        keras.mixed_precision.set_global_policy(policy)
    return model.get_weights()


def test_loss_scaling_skips_a_step_when_any_replica_overflows():
    """One device skips the step (inf in the batch); stock Keras asks only replica 0."""
    want = _train_one_replica_overflows(get("one_device", device="/cpu:0"))
    got = _train_one_replica_overflows(get("mirrored", cpu_replicas=2))
    assert _max_difference(got, want) < 1e-6  # Same skipped steps, then fp16 round-off only.
    stock = _train_one_replica_overflows(get("mirrored", cpu_replicas=2), stock=True)
    assert not all(np.isfinite(w).all() for w in stock)  # Upstream still applies the inf.


def test_stock_keras_still_clips_before_the_all_reduce():
    """Fails when upstream fixes it: then set `_FIXED_IN` and retire the patch."""
    assert _max_difference(_train_stock("global_clipnorm"), _reference("global_clipnorm")) > 1e-2


def test_stock_keras_still_crashes_on_gradient_accumulation():
    with pytest.raises(RuntimeError, match="merge_call"):
        _train_stock("accumulation")
    assert keras_optimizer.is_applied()


def test_accumulators_are_replica_local_sums():
    strategy = get("mirrored", cpu_replicas=2)
    with strategy.scope():
        model = workers.build_model(workers.OPTIONS["accumulation"])
        model.optimizer.build(model.trainable_variables)
    accumulators = model.optimizer._accumulated_gradients
    assert all(a.value.synchronization == tf.VariableSynchronization.ON_READ for a in accumulators)
    assert all(a.value.aggregation == tf.VariableAggregation.SUM for a in accumulators)


class _Fault(RuntimeError):
    pass


class _FailAtMicroStep(keras.callbacks.Callback):
    # tfscale.callbacks.FailAt counts `optimizer.iterations`, which under gradient
    # accumulation counts optimizer steps (every k-th batch); this counts batches.
    def __init__(self, step):
        super().__init__()
        self.step, self.done = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            raise _Fault(f"injected after micro-step {self.step}")


def test_backup_mid_accumulation_cycle_resumes_exactly(tmp_path):
    """A fault 2 micro-steps into a k=4 cycle: the backup holds the replicas' partial sums."""
    import tfscale.callbacks

    option, backup_dir = "accumulation_clip", str(tmp_path / "backup")

    def run(*extra):
        backup = tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=3, delete_checkpoint=False)
        weights = workers.train(get("mirrored", cpu_replicas=2), option, callbacks=[backup, *extra])
        return weights, backup

    with pytest.raises(_Fault):
        run(_FailAtMicroStep(6))  # After the backup at micro-step 6 (6 % 4 == 2).
    saved = np.load(f"{backup_dir}/ckpt-000000000006/shard-00000.npz")
    accumulators = [saved[k] for k in saved.files[-len(workers.build_model({}).trainable_weights) :]]
    assert all(np.abs(a).max() > 0 for a in accumulators)  # Mid-cycle: partial sums saved.
    weights, backup = run()
    assert backup.restored_from["global_step"] == 6
    assert _max_difference(weights, _reference(option)) < 1e-6


MULTI_WORKER_OPTIONS = ("clipnorm", "global_clipnorm", "weight_decay", "ema", "accumulation_clip")


@pytest.mark.slow
def test_multi_worker_optimizer_options_match_one_device():
    from tfscale.launch import run_local_cluster

    results = run_local_cluster(
        workers.multi_worker_runs,
        2,
        args=(MULTI_WORKER_OPTIONS,),
        timeout=400,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    for result in results:
        assert result.value["replicas"] == 2
        for option in MULTI_WORKER_OPTIONS:
            assert _max_difference(result.value["weights"][option], _reference(option)) < 1e-6, option
        # fp16 on the wire rounds each summed gradient to 11 bits; Adam (lr 0.05,
        # 16 steps) carries that into the weights at the 1e-3 level.
        assert _max_difference(result.value["fp16"], _reference("plain")) < 1e-2


def test_optimizer_state_that_names_cannot_match_is_paired_through_the_index_and_attributes():
    """tfscale.compat.keras_optimizer_state: fails when Keras stops keeping Adafactor's factored
    slots in lists indexed by `_get_variable_index`, or Nadam's `_u_product` as an attribute."""
    from tfscale.compat import keras_optimizer_state

    def built(cls, shapes):
        variables = [keras.Variable(np.ones(s, "float32"), name="kernel") for s in shapes]
        optimizer = cls(0.1)
        optimizer.build(variables)
        return optimizer, variables

    # The source holds its variables in the other order: only the index pairs them right.
    source, theirs = built(keras.optimizers.Adafactor, [(3, 2), (4, 5)])
    target, mine = built(keras.optimizers.Adafactor, [(4, 5), (3, 2)])
    for k, slot in enumerate(source._r + source._c):
        slot.assign(np.full(slot.shape, k + 1.0, "float32"))
    pairs = [
        (id(a), id(b)) for a, b in keras_optimizer_state.indexed_pairs(source, target, theirs[0], mine[1])
    ]
    # Adafactor's `_v` holds a placeholder of shape () for a factored variable: paired too.
    assert pairs == [(id(getattr(target, n)[1]), id(getattr(source, n)[0])) for n in ("_r", "_c", "_v")]
    assert keras_optimizer_state.supported(source)

    nadam, _ = built(keras.optimizers.Nadam, [(3, 2)])
    other, _ = built(keras.optimizers.Nadam, [(3, 2)])
    assert any(
        a is other._u_product and b is nadam._u_product
        for a, b in keras_optimizer_state.attribute_pairs(nadam, other)
    )
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Nadam(0.1))
    scaled.build([keras.Variable(np.ones((3, 2), "float32"))])
    inner = [
        b
        for a, b in keras_optimizer_state.attribute_pairs(scaled, scaled)
        if b is scaled.inner_optimizer._u_product
    ]
    assert inner, "the inner optimizer of a LossScaleOptimizer is searched too"


def test_optimizer_state_pairs_are_none_without_the_private_index(monkeypatch):
    from tfscale.compat import keras_optimizer_state

    optimizer = keras.optimizers.Adafactor(0.1)
    variable = keras.Variable(np.ones((3, 2), "float32"))
    optimizer.build([variable])
    monkeypatch.setattr(optimizer, "_get_variable_index", None)  # as if Keras dropped it
    assert not keras_optimizer_state.supported(optimizer)
    assert list(keras_optimizer_state.indexed_pairs(optimizer, optimizer, variable, variable)) == []


@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_a_merge_after_freezing_a_layer_keeps_the_optimizer_state(optimizer):
    """Fine-tuning: train split, freeze the first layer, merge (or save). The merged optimizer
    holds one variable less, so the variables' indices differ between the two optimizers; read
    at those indices, the optimizer's list of all its own variables gave the merged
    `iterations` the learning rate's value (0 after 2 steps, so Adam restarted its bias correction)."""
    x = np.random.RandomState(0).rand(16, 4).astype("float32")
    y = np.random.RandomState(1).rand(16, 4).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), *[keras.layers.Dense(4, use_bias=False) for _ in range(3)]])
    strategy = get("model_split", num_devices=2)
    split = strategy.split(model)
    split.compile(keras.optimizers.get(optimizer), "mse")
    split.fit(x, y, batch_size=8, epochs=1, verbose=0)
    split.layers[0].trainable = False
    merged = strategy.merge(split)
    source, target = split.optimizer, merged.optimizer
    assert int(target.iterations.numpy()) == int(source.iterations.numpy()) == 2
    by_path = {w.path: w for w in split.weights}
    slots = ("_momentums", "_velocities") if optimizer == "adam" else ("_r", "_c")
    for j, variable in enumerate(target._trainable_variables):
        i = source._get_variable_index(by_path[variable.path])
        for name in slots:
            np.testing.assert_array_equal(getattr(target, name)[j].numpy(), getattr(source, name)[i].numpy())
