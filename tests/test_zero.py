"""ZeRO stages 1-2 (`zero_stage=`) train to plain Keras's weights; slots are 1/N; bad input refused."""

import math
import re

import keras
import numpy as np
import pytest

import tfscale.callbacks
import tfscale.strategies
from tfscale.compat import keras_optimizer_zero
from tfscale.compat.keras_optimizer_zero import ZeroError
from tfscale.strategies import StrategyError

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_zero_trains_to_one_device_and_stage_0_weights": 1,  # SGD with momentum, 2 replicas
    # 4 -> 2 (a resharded restore); 4 -> 4 took 10-28 s in the fast tier (4 replicas, 2 cores)
    "test_zero_job_killed_mid_epoch_resumes_exactly_on_any_number_of_replicas": 1,
    "test_an_embedding_seeing_a_token_twice_trains_to_one_device_weights": 1,  # Adam, stage 1
    "test_another_models_backup_is_refused_whole_between_zero_and_plain_jobs": 2,
}


ATOL = 1e-6
OPTIMIZERS = {
    "sgd_momentum": lambda **o: keras.optimizers.SGD(0.1, momentum=0.9, **o),
    "adam": lambda **o: keras.optimizers.Adam(0.05, **o),
    "adamw": lambda **o: keras.optimizers.AdamW(0.05, **o),
}
OPTIONS = {
    "plain": {},
    "clipnorm": dict(clipnorm=0.1),
    "global_clipnorm": dict(global_clipnorm=0.2),
    "clipvalue": dict(clipvalue=0.05),
    "weight_decay": dict(weight_decay=0.1),
    "ema": dict(use_ema=True),
    "accumulation": dict(gradient_accumulation_steps=2),
}
# Each option with one optimizer, rotating (generated, not hand-picked), on 2 or 4 replicas.
CASES = [
    (opt, option, replicas, stage)
    for i, option in enumerate(OPTIONS)
    for opt in [list(OPTIMIZERS)[i % len(OPTIMIZERS)]]
    for replicas, stage in [(2, 1), (4, 2)]
]


def _fit(strategy, make_optimizer):
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(16, 5).astype("float32")
    y = np.random.RandomState(1).randn(16, 3).astype("float32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile(make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(("opt", "option", "replicas", "stage"), CASES)
def test_zero_trains_to_one_device_and_stage_0_weights(opt, option, replicas, stage):
    make = lambda: OPTIMIZERS[opt](**OPTIONS[option])  # noqa: E731
    one = _fit(tfscale.strategies.get("default"), make).get_weights()
    stage0 = _fit(tfscale.strategies.get("mirrored", cpu_replicas=replicas), make).get_weights()
    zero = _fit(
        tfscale.strategies.get("mirrored", cpu_replicas=replicas, zero_stage=stage), make
    ).get_weights()
    for a, b, c in zip(zero, one, stage0):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
        np.testing.assert_allclose(a, c, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("opt", "stage"), [("adam", 1), ("adagrad", 2), ("rmsprop", 1), ("adamw", 2)])
def test_an_embedding_seeing_a_token_twice_trains_to_one_device_weights(opt, stage):
    # Its gradient is IndexedSlices with a repeated row: Keras's update squares each row
    # before adding them (Adam's velocity), so a shard must keep them apart too.
    make = {
        "adam": lambda: keras.optimizers.Adam(0.05),
        "adagrad": lambda: keras.optimizers.Adagrad(0.5, clipnorm=0.1),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.05, global_clipnorm=0.1),
        "adamw": lambda: keras.optimizers.AdamW(0.05, gradient_accumulation_steps=2),
    }[opt]
    tokens = np.array([[1, 1, 3, 5], [2, 7, 7, 7], [4, 4, 4, 4], [0, 6, 6, 1]] * 4, "int32")
    y = np.random.RandomState(1).randn(16, 3).astype("float32")

    def fit(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((4,), dtype="int32"), keras.layers.Embedding(8, 5),
                 keras.layers.Flatten(), keras.layers.Dense(3)]
            )  # fmt: skip
            model.compile(make(), loss="mse")
        model.fit(tokens, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    one = fit(tfscale.strategies.get("default"))
    zero = fit(tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=stage))
    for a, b in zip(zero, one, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_optimizer_bytes_per_replica_are_one_nth_plus_padding():
    def report(stage):
        strategy = tfscale.strategies.get("mirrored", cpu_replicas=4, zero_stage=stage)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7), keras.layers.Dense(3)])
            model.compile(keras.optimizers.Adam(gradient_accumulation_steps=2), "mse")
            model.optimizer.build(model.trainable_variables)
        return tfscale.strategies.memory_report(model), [
            v.shape.num_elements() for v in model.trainable_variables
        ]

    scalars = 8 + 4  # iterations (int64), learning_rate (float32)
    (r0, sizes), (r1, _), (r2, _) = report(0), report(1), report(2)
    shards = sum(math.ceil(n / 4) for n in sizes)  # 18 elements for 66 parameters
    assert len(r1) == 4
    for device in r0:
        assert r0[device] == {"parameters": 66 * 4, "optimizer": 2 * 66 * 4 + scalars, "gradients": 66 * 4}
        # Two slots and the parameter shard the update writes into, each 1/4 (+ padding).
        assert r1[device] == {
            "parameters": 66 * 4,
            "optimizer": 3 * shards * 4 + scalars,
            "gradients": 66 * 4,
        }
        assert r2[device] == {
            "parameters": 66 * 4,
            "optimizer": 3 * shards * 4 + scalars,
            "gradients": shards * 4,
        }


@pytest.mark.parametrize("stage", [True, 1.0, "1", -1, 4])
def test_bad_zero_stage_is_one_line(stage):
    with pytest.raises(StrategyError, match=r"zero_stage=") as info:
        tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=stage)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["one_device", "default", "tpu", "pipeline", "model_split", "multi_worker"])
def test_zero_stage_with_unmirrored_strategy_is_refused(name):
    with pytest.raises(StrategyError, match=rf"zero_stage=1.*{name}"):
        tfscale.strategies.get(name, zero_stage=1)


@pytest.mark.parametrize("make", [keras.optimizers.Lamb, keras.optimizers.Adafactor, keras.optimizers.Muon])
def test_unshardable_optimizer_is_refused_before_a_step(make):
    strategy = tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7)])
        model.compile(make(), "mse")
    before = model.get_weights()
    with pytest.raises(ZeroError, match=rf"cannot shard optimizer {make.__name__}"):
        model.fit(np.ones((4, 5)), np.ones((4, 7)), verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)


class _RaiseAfterBatches(keras.callbacks.Callback):
    # Counts batches, not updates (FailAt counts `optimizer.iterations`, which under
    # gradient accumulation advances once per update): so it can stop between micro-steps.
    def __init__(self, batches):
        super().__init__()
        self.left = batches

    def on_train_batch_end(self, batch, logs=None):
        self.left -= 1
        if self.left == 0:
            raise tfscale.callbacks.InjectedFault(f"after batch {batch}")


def _fit_with_backup(strategy, backup_dir, make_optimizer, fail_at=None):
    """3 epochs of 4 batches under `strategy`, backed up every batch; `fail_at`: raise after that many."""
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).randn(32, 5).astype("float32")
    y = np.random.RandomState(1).randn(32, 3).astype("float32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile(make_optimizer(), loss="mse")
    callbacks = []
    if backup_dir is not None:
        callbacks.append(tfscale.callbacks.BackupAndRestore(str(backup_dir), save_freq=1))
    if fail_at is not None:
        callbacks.append(_RaiseAfterBatches(fail_at))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return model, callbacks[0] if callbacks else None


def _optimizer_state(model):
    """Every optimizer variable's whole value by name (a ZeRO slot's shards put together)."""
    optimizer = model.optimizer
    out = {}
    for v in optimizer.variables:
        if keras_optimizer_zero.is_derived(optimizer, v):
            continue
        shape = keras_optimizer_zero.full_shape(optimizer, v)
        value = (
            v.numpy()
            if shape is None
            else keras_optimizer_zero.join_shards(
                [c.numpy() for c in keras_optimizer_zero.components(v)], shape
            )
        )
        out[re.sub(r"_[0-9]+(?=_|/|$)", "", v.path)] = value
    return out


# (stage and optimizer of the job that is killed, replicas before -> after the restart).
# Stage 2 with accumulation is killed after step 5: between the two micro-steps of an update.
# 0 replicas: plain Keras on one device (the default strategy).
RESUME_CASES = [
    (1, "adam_ema", 4, 2),  # first: the fast tier's case (resharded from 4 to 2 replicas)
    (1, "adam_ema", 4, 4),
    (2, "adamw_accumulation", 4, 2),
    (2, "adamw_accumulation", 2, 1),
    (1, "adam_ema", 2, 0),  # resumed as plain Keras on one device
    (1, "adam_ema", 0, 2),  # plain Keras's backup resumed under ZeRO
]
RESUME_OPTIMIZERS = {
    "adam_ema": lambda: keras.optimizers.Adam(0.05, use_ema=True, clipnorm=0.5),
    "adamw_accumulation": lambda: keras.optimizers.AdamW(0.05, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize(("stage", "opt", "before", "after"), RESUME_CASES)
def test_zero_job_killed_mid_epoch_resumes_exactly_on_any_number_of_replicas(
    tmp_path, stage, opt, before, after
):
    make = RESUME_OPTIMIZERS[opt]
    reference, _ = _fit_with_backup(tfscale.strategies.get("default"), None, make)

    def strategy(replicas):
        if replicas == 0:
            return tfscale.strategies.get("default")
        return tfscale.strategies.get("mirrored", cpu_replicas=replicas, zero_stage=stage)

    with pytest.raises(tfscale.callbacks.InjectedFault):
        _fit_with_backup(strategy(before), tmp_path, make, fail_at=5)
    resumed, backup = _fit_with_backup(strategy(after), tmp_path, make)
    assert backup.restored_from["global_step"] == 5  # it resumed, it did not start again
    updates = 12 // (make().gradient_accumulation_steps or 1)
    assert int(resumed.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == updates
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    theirs, ours = _optimizer_state(reference), _optimizer_state(resumed)
    assert sorted(theirs) == sorted(ours)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], atol=ATOL, rtol=0, err_msg=name)


# Another model's backup, each way it can differ: refused in one line, nothing loaded.
OTHER_MODELS = {
    "wider": (lambda: [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)], "adam"),
    "deeper": (lambda: [keras.layers.Dense(7), keras.layers.Dense(7), keras.layers.Dense(3)], "adam"),
    "optimizer": (lambda: [keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)], "rmsprop"),
    "slots": (lambda: [keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)], "amsgrad"),
}
_OTHER_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "amsgrad": lambda: keras.optimizers.Adam(0.05, amsgrad=True),
}


@pytest.mark.parametrize("other", sorted(OTHER_MODELS))
@pytest.mark.parametrize("into_zero", [True, False])
def test_another_models_backup_is_refused_whole_between_zero_and_plain_jobs(tmp_path, other, into_zero):
    x = np.random.RandomState(0).randn(16, 5).astype("float32")
    y = np.random.RandomState(1).randn(16, 3).astype("float32")
    zero = tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=1)
    plain = tfscale.strategies.get("default")

    def build(strategy, layers, opt):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), *layers])
            model.compile(_OTHER_OPTIMIZERS[opt](), loss="mse")
        return model

    def fit(model, *extra):
        backup = tfscale.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[backup, *extra])

    layers, opt = OTHER_MODELS[other]
    with pytest.raises(tfscale.callbacks.InjectedFault):  # the other model's job, backed up at step 1
        fit(build(plain if into_zero else zero, layers(), opt), _RaiseAfterBatches(1))
    saved = sorted(p.name for p in (tmp_path / "backup").iterdir())
    model = build(zero if into_zero else plain, OTHER_MODELS["optimizer"][0](), "adam")
    before = model.get_weights()
    with pytest.raises(tfscale.callbacks.BackupMismatchError, match=r"was made by a different model") as info:
        fit(model)
    assert "\n" not in str(info.value)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == saved  # the user's backup kept
