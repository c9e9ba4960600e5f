"""tfscale.compat: version gates and in-process effects of the Keras 3 fixes.

The multi-worker behaviour the fixes exist for is tested on real clusters in
tests/test_multi_worker.py (with and without the fix).
"""

import importlib.util
import inspect
import os
import signal
import subprocess
import sys
import threading
import types
from unittest import mock

import _foundation_workers as workers
import numpy as np
import pytest
import tensorflow as tf
from _compat_gate import version_gate_test

import tfscale.compat
from tfscale.compat import keras_multi_worker
from tfscale.strategies import get

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_steps_per_execution_under_mirrored_trains_and_evaluates_as_one_device": 1,
}


test_fix_is_version_gated = version_gate_test(keras_multi_worker)


def test_apply_is_a_no_op_where_upstream_is_fixed():
    from keras.src.backend.tensorflow import trainer

    before = (trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica)
    state = {"applied": False}
    with (
        mock.patch.object(keras_multi_worker, "_state", state),
        mock.patch.object(keras_multi_worker, "_FIXED_IN", "3.0.0"),
    ):
        assert tfscale.compat.apply_multi_worker_fixes() is False
    assert (trainer.TensorFlowTrainer._maybe_symbolic_build, trainer.reduce_per_replica) == before


@pytest.mark.slow  # 23 s; fast tier: test_strategies' mirrored vs one device
def test_fixed_keras_still_matches_one_device_under_mirrored():
    """The patched functions must not change single-host results."""
    reference = workers.train_and_report(get("one_device", device="/cpu:0"))
    assert tfscale.compat.apply_multi_worker_fixes() is True
    assert tfscale.compat.apply_multi_worker_fixes() is True  # idempotent
    assert keras_multi_worker.is_applied()
    run = workers.train_and_report(get("mirrored", cpu_replicas=2))
    for got, want in zip(run["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run["predict"], reference["predict"], rtol=1e-5, atol=1e-6)


# What `get("mirrored" | "multi_worker")` calls in tfscale.compat to build and configure
# the strategy object itself: not Keras fixes, so a hand-built strategy needs none of them.
STRATEGY_PLUMBING = {
    "tfscale.compat.collective_keys.reserve_key_range",
    "tfscale.compat.tf_communication.attach",
    "tfscale.compat.keras_optimizer_zero.set_stage",
    "tfscale.compat.keras_batch_norm.keep_replica_statistics",
    "tfscale.compat.keras_random_layers.keep_replica_random",
}


def _record_compat_calls(monkeypatch):
    """Records (and still runs) every outermost call of a public function of a tfscale.compat module.

    Outermost: `apply()` calling its own `needed()` is not recorded (only the first `apply`
    in a process does).
    """
    calls, depth = [], [0]

    def recording(qualified, function):
        def record(*args, **kwargs):
            if not depth[0]:
                calls.append(qualified)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return record

    for name, module in list(sys.modules.items()):
        if name.startswith("tfscale.compat."):
            for attribute in getattr(module, "__all__", ()):
                function = getattr(module, attribute, None)
                if inspect.isfunction(function):
                    monkeypatch.setattr(module, attribute, recording(f"{name}.{attribute}", function))
    return calls


def _keras_compat_shim():
    from tfscale.launch.jobs import keras_compat_dir

    path = os.path.join(keras_compat_dir(), "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("_tfscale_keras_compat_under_test", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)  # Keras is loaded here already: installs no hook
    return shim


class _LoadedKeras:
    """Stands in for Keras's own loader: the module is already loaded."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


def test_keras_compat_shim_applies_the_fixes_get_applies_for_mirrored_and_multi_worker(monkeypatch):
    """`tfscale-launch --keras_compat` once applied only the multi-worker fix: a hand-built MWMS
    then clipped per replica and took per-replica loss means. Now the shim and both builders
    apply one list (`tfscale.compat.apply_strategy_fixes`); a fix added to one only fails here."""
    from tfscale.strategies import _builtin, _communication

    calls = _record_compat_calls(monkeypatch)
    get("mirrored", cpu_replicas=2)
    mirrored = list(calls)
    calls.clear()
    # The multi-worker builder's fixes without a cluster: the strategy itself is not built.
    monkeypatch.setattr(_builtin, "build_within", lambda *args: types.SimpleNamespace())
    monkeypatch.setattr(_communication, "configure", lambda *args, **kwargs: None)
    get("multi_worker")
    multi_worker = list(calls)
    calls.clear()
    shim = _keras_compat_shim()
    shim._ApplyAfterLoad(_LoadedKeras()).exec_module(types.ModuleType("keras"))
    shimmed = list(calls)

    fixes = {"tfscale.compat." + name for name in ("keras_multi_worker.apply", "keras_optimizer.apply",
                                                    "keras_loss_denominator.apply",
                                                    "keras_batch_norm.apply",
                                                    "keras_random_layers.apply")}  # fmt: skip
    assert fixes <= set(shimmed)
    assert set(mirrored) - STRATEGY_PLUMBING == set(shimmed)
    assert set(multi_worker) - STRATEGY_PLUMBING == set(shimmed)
    for run in (mirrored, multi_worker, shimmed):
        # The iterator parking wraps the trainer's `_maybe_symbolic_build`, which the
        # multi-worker fix replaces: it must be applied after it, or it is lost.
        last_parking = (
            len(run) - 1 - run[::-1].index("tfscale.compat.keras_symbolic_build.keep_first_input_iterator")
        )
        assert run.index("tfscale.compat.keras_multi_worker.apply") < last_parking


def test_keras_compat_shim_prints_one_line_and_lets_the_program_run_when_a_fix_fails(monkeypatch, capsys):
    def fail():
        raise RuntimeError("no such Keras internals")

    monkeypatch.setattr(tfscale.compat, "apply_strategy_fixes", fail)
    shim = _keras_compat_shim()
    shim._ApplyAfterLoad(_LoadedKeras()).exec_module(types.ModuleType("keras"))
    err = capsys.readouterr().err
    assert err == (
        "tfscale-launch --keras_compat: could not apply the Keras fixes: "
        "RuntimeError('no such Keras internals')\n"
    )


def test_apply_strategy_fixes_puts_every_data_parallel_fix_in_effect():
    """All five data-parallel fixes, and the iterator parking still in effect after them: the
    multi-worker fix replaces `_maybe_symbolic_build`, so a process's first `get("mirrored")`
    used to drop the parking `get` had applied just before (until the next `get`)."""
    applied = tfscale.compat.apply_strategy_fixes()
    assert applied == {
        "multi_worker": True,
        "optimizer": True,
        "loss": True,
        "batch_norm": True,
        "random_layers": True,
    }
    from keras.src.backend.tensorflow import trainer

    build = trainer.TensorFlowTrainer._maybe_symbolic_build
    assert getattr(build, "_tfscale_kept", False)  # the parking, around the multi-worker build
    assert build.__wrapped__.__module__ == "tfscale.compat.keras_multi_worker"


@pytest.mark.slow  # 23 s, three mirrored runs; fast tier: the mirrored run above
def test_hand_built_and_tfscale_mirrored_strategies_coexist_in_one_process():
    """Without fresh collective keys the second strategy aborts ("joining a group with size 4").

    (Two hand-built strategies of different sizes in one process still clash: that
    is TensorFlow's behaviour, which tfscale cannot change for objects it did not build.)
    """
    runs = []
    for strategy in (
        tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
        get("mirrored", cpu_replicas=4),
        tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    ):
        runs.append(workers.train_and_report(strategy))
    for run in runs[1:]:
        for got, want in zip(run["weights"], runs[0]["weights"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_global_batch_not_divisible_by_replicas_trains_as_one_device():
    """16 examples over 3 replicas (6, 6, 4): stock Keras 3 fails building the model.

    With keras_multi_worker's symbolic-build fix it trains; with keras_loss_denominator's
    (each replica's loss divided by the global batch's size, not its own) it trains as one
    device does, though the replicas' slices differ in size.
    """
    reference = workers.train_and_report(get("one_device", device="/cpu:0"))
    run = workers.train_and_report(get("mirrored", cpu_replicas=3))
    assert run["replicas"] == 3
    for got, want in zip(run["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key, want in reference["history"].items():
        np.testing.assert_allclose(run["history"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    for key, want in reference["evaluate"].items():
        np.testing.assert_allclose(run["evaluate"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)


# What TensorFlow's preemption notifier does from a runtime thread (a C-level SIGTERM
# handler that keeps the process alive; SIG_IGN here), inside `SigtermDefault`; then a
# real SIGTERM once the action reads as the default again (a bounded wait).
_SIGTERM_CHILD = """
import ctypes, importlib.util, os, signal, sys, threading, time
# The module alone (it imports nothing of TensorFlow; the package would, ~5 s).
spec = importlib.util.spec_from_file_location("tf_sigterm", sys.argv[1])
tf_sigterm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tf_sigterm)
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
def action():
    old = ctypes.create_string_buffer(512)  # struct sigaction; its handler comes first
    assert libc.sigaction(signal.SIGTERM, None, old) == 0
    return ctypes.c_void_p.from_buffer(old).value or 0
assert tf_sigterm.available()
with tf_sigterm.SigtermDefault():
    installer = threading.Thread(target=libc.signal, args=(signal.SIGTERM, ctypes.c_void_p(1)))
    installer.start()
    installer.join()
    deadline = time.monotonic() + 30
    while action() != 0 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(30)
print("survived SIGTERM")
"""


def test_sigterm_default_undoes_a_c_level_handler_installed_meanwhile():
    import tfscale.compat.tf_sigterm

    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_CHILD, tfscale.compat.tf_sigterm.__file__],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr[-2000:]


def test_the_profiler_barrier_is_available_and_a_single_process_only_syncs():
    from tfscale.compat import tf_barrier

    assert tf_barrier.available()
    # One process: pending ops only (no coordination service to ask).
    assert tf_barrier.quiesce("tfscale-test", multi_worker=False, timeout_s=5) is True


_CLUSTERS = {
    "workers": {"worker": ["localhost:1", "localhost:2", "localhost:3"]},
    "chief and workers": {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]},
}


@pytest.mark.parametrize("cluster", sorted(_CLUSTERS))
def test_under_multi_worker_only_tensorflows_collective_leader_may_run_the_profiler(cluster):
    from tensorflow.python.distribute import multi_worker_util

    from tfscale.cluster import ClusterSpec
    from tfscale.compat import tf_traceme_split

    leader = multi_worker_util.collective_leader(_CLUSTERS[cluster], "worker", 0)
    tasks = [(t, i) for t in _CLUSTERS[cluster] for i in range(len(_CLUSTERS[cluster][t]))]
    allowed = []
    for task_type, index in tasks:
        spec = ClusterSpec.from_tf_config(
            {"cluster": _CLUSTERS[cluster], "task": {"type": task_type, "index": index}}
        )
        if tf_traceme_split.may_trace(multi_worker=spec.is_multi_worker, collective_leader=spec.is_chief):
            allowed.append(f"/job:{task_type}/replica:0/task:{index}")
    # The leader resolves collective params on the launching thread (no split TraceMe events).
    assert allowed == [leader]
    assert tf_traceme_split.may_trace(multi_worker=False, collective_leader=False)


def test_the_traceme_split_gate_is_closed_on_the_checked_tensorflow():
    from tfscale.compat import tf_traceme_split

    assert tf_traceme_split.every_worker_can_trace() is False
    with mock.patch.object(tf_traceme_split, "FIXED_IN", "2.22"):
        assert tf_traceme_split.every_worker_can_trace("2.21.0") is False
        assert tf_traceme_split.every_worker_can_trace("2.22.1") is True
        assert tf_traceme_split.may_trace(multi_worker=True, collective_leader=False, version="2.22.0")


# --- compat.tf_custom_gradient: a traced custom gradient no longer pins its graph --------------


def _custom_gradient_entries():
    from tensorflow.python.framework import ops

    return {k for k in ops._gradient_registry._registry if k.startswith("CustomGradient-")}


def _fit_once_and_forget():
    """A plain Keras fit (one device): its traced step registers TF's all_reduce custom gradient."""
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0)


def test_a_traced_custom_gradient_is_released_with_its_graph_and_still_differentiates():
    import gc

    from tfscale.compat import tf_custom_gradient

    assert tf_custom_gradient.release_with_graph() and tf_custom_gradient.release_with_graph()
    before = _custom_gradient_entries()
    for _ in range(3):
        _fit_once_and_forget()
    gc.collect()
    # Without the fix each fit leaves its entries (and with them its whole traced graph).
    assert _custom_gradient_entries() - before == set()

    # While its graph lives the gradient is found and is the custom one, also when the
    # backward pass is built after the trace ended (an outer tape over a tf.function call).
    @tf.custom_gradient
    def scaled(x):
        return tf.identity(x), lambda dy: 10.0 * dy

    f = tf.function(lambda x: scaled(x) * 2.0)
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = f(x)
    assert np.allclose(tape.gradient(y, x).numpy(), [20.0, 20.0])
    assert len(_custom_gradient_entries() - before) == 1  # f's graph is alive: its entry too
    del f, y, tape
    gc.collect()
    assert _custom_gradient_entries() - before == set()


# --- compat.keras_symbolic_build: a strategy fit's first iterator is not torn down live ---------


def _stop_at_begin_fit(model, x, y):
    import keras

    class Stop(Exception):
        pass

    class StopAtBegin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            raise Stop()

    with pytest.raises(Stop):
        model.fit(x, y, batch_size=4, epochs=2, callbacks=[StopAtBegin()], verbose=0)


def test_a_strategy_fit_builds_its_model_from_the_dataset_specs_with_no_iterator_and_trains_as_keras():
    """Keras makes a distributed iterator only to read the first batch's shapes and drops it
    while it still prefetches (the crash of tests/_iterator_teardown_repro.py; parked instead,
    its teardown stalled later fits up to 119 s). Built from the dataset's `element_spec`, no
    iterator is made before the first step, and the weights are those of Keras's own path."""
    import keras
    from keras.src.backend.tensorflow import trainer
    from tensorflow.python.distribute import input_lib

    strategy = get("mirrored", cpu_replicas=2)  # applies the fix; per-replica specs
    assert getattr(trainer.TensorFlowTrainer._maybe_symbolic_build, "_tfscale_kept", False)
    x, y = np.arange(48, dtype="float32").reshape(16, 3) / 48, np.ones((16, 2), "float32")

    def build():
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    made = []
    iterate = input_lib.DistributedDataset.__iter__

    def counting(self):
        made.append(self)
        return iterate(self)

    def fit_twice(model):
        with mock.patch.object(input_lib.DistributedDataset, "__iter__", counting):
            _stop_at_begin_fit(model, x, y)  # raises in on_train_begin, after the build
            stopped = len(made)
            model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        made.clear()
        return stopped, model.get_weights()

    stopped, patched = fit_twice(build())
    assert stopped == 0  # the model was built, and no iterator made
    with mock.patch.object(
        trainer.TensorFlowTrainer,
        "_maybe_symbolic_build",
        trainer.TensorFlowTrainer._maybe_symbolic_build.__wrapped__,
    ):
        stopped, unpatched = fit_twice(build())
    assert stopped == 1  # Keras's own path: one iterator, for the build
    for a, b in zip(patched, unpatched, strict=True):
        np.testing.assert_array_equal(a, b)


class _CollectionCounter:
    """Counts garbage collections of any generation from start() to stop()."""

    def __init__(self):
        self.started = []

    def _count(self, phase, info):
        if phase == "start":
            self.started.append(info["generation"])

    def start(self):
        import gc

        gc.callbacks.append(self._count)

    def stop(self):
        import gc

        if self._count in gc.callbacks:
            gc.callbacks.remove(self._count)
        return len(self.started)


@pytest.mark.parametrize("where", ["train", "validation"])
def test_a_fit_that_raises_parks_its_live_iterators_and_leaves_no_cycle_for_the_collector(where):
    """Keras keeps a raising fit's epoch iterator in its own cycle (tests/test_compat_backup.py),
    torn down live by a later garbage collection: slow (seconds each, tests/_gc_probe.py) and
    the teardown race of tests/_iterator_teardown_repro.py. With tfscale's `fit` wrapper the
    live iterators are parked and the epoch iterators freed by reference counting, with no
    collection; the next fit frees the parked ones."""
    import weakref

    import keras

    from tfscale.compat import keras_fit_position, keras_symbolic_build

    strategy = get("one_device")  # applies the fix
    x, y = np.arange(96, dtype="float32").reshape(32, 3) / 96, np.ones((32, 2), "float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")

    class Stop(Exception):
        pass

    class StopIn(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_iterators, self.live, self.collections = [], [], _CollectionCounter()

        def _stop(self, epoch_iterators):
            self.epoch_iterators = [weakref.ref(e) for e in epoch_iterators]
            self.live = [weakref.ref(e._current_iterator) for e in epoch_iterators]
            self.collections.start()  # from the raise to the check after fit
            raise Stop()

        def on_train_batch_end(self, batch, logs=None):
            if where == "train" and batch == 1:
                self._stop([keras_fit_position.find_epoch_iterator(self.model)])

        def on_test_batch_end(self, batch, logs=None):
            if where == "validation":
                training = keras_fit_position.find_epoch_iterator(self.model)
                self._stop([training, self.model._eval_epoch_iterator])

    def interrupted_fit():
        stop = StopIn()
        try:
            model.fit(x, y, batch_size=4, epochs=2, validation_split=0.25, callbacks=[stop], verbose=0)
        except Stop:
            pass
        return stop

    for _ in range(3):  # a collection that starts on its own in the window makes a try inconclusive
        before = keras_symbolic_build.parked_iterators()
        stop = interrupted_fit()
        collections = stop.collections.stop()
        parked = [i for i in keras_symbolic_build.parked_iterators() if not any(i is b for b in before)]
        del before
        if collections == 0:
            break
    assert collections == 0, "a garbage collection ran in each of 3 tries: inconclusive"
    assert stop.epoch_iterators[0]() is None  # the training epoch iterator: freed, no collection
    if where == "validation":
        assert stop.epoch_iterators[1]() is model._eval_epoch_iterator  # Keras keeps it till the next fit
    live = [ref() for ref in stop.live]
    assert all(i is not None and any(i is p for p in parked) for i in live)  # parked, not torn down
    assert len(parked) == len(live)  # only those: the model was built with no iterator
    parked = [weakref.ref(i) for i in parked]
    del live
    with mock.patch.object(keras_symbolic_build, "_IDLE_AFTER", 0.0):  # idle at once, for the test
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert keras_symbolic_build.wait_until_freed(timeout_s=60)
    assert [ref() for ref in parked] == [None] * len(parked)  # freed once the next fit started
    assert all(ref() is None for ref in stop.epoch_iterators)


class _SlowToFree:
    """Stands for a parked iterator whose teardown waits (TensorFlow's background threads)."""

    def __init__(self, release, freed_in):
        self.release, self.freed_in = release, freed_in

    def __del__(self):
        self.release.wait(30)
        self.freed_in.append(threading.current_thread().name)


def test_parked_iterators_are_freed_beside_the_next_fit_one_fits_worth_at_a_time(caplog):
    # A teardown waits, idle, for seconds on a busy machine (tests/_parked_free_repro.py): the
    # fit that frees them does not wait for it; the next one does, bounded, with a warning.
    from tfscale.compat import keras_symbolic_build

    release, freed_in = threading.Event(), []
    keras_symbolic_build.wait_until_freed(timeout_s=60)
    with keras_symbolic_build._lock:
        keras_symbolic_build._PARKED.append((0.0, _SlowToFree(release, freed_in)))
    keras_symbolic_build._release_parked()  # returns with the teardown still waiting
    assert freed_in == []
    assert keras_symbolic_build.parked_iterators() == []
    with caplog.at_level("WARNING", logger="tfscale"):
        assert not keras_symbolic_build.wait_until_freed(timeout_s=0.2)  # bounded
    assert "Freeing the input iterators of an interrupted fit has taken over 0 s" in caplog.text
    release.set()
    assert keras_symbolic_build.wait_until_freed(timeout_s=60)
    assert freed_in == ["tfscale-free-parked-iterators"]


# --- compat.keras_steps_per_execution: steps_per_execution > 1 on 2+ replicas -------------------


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_steps_per_execution_under_mirrored_trains_and_evaluates_as_one_device(steps_per_execution):
    """Keras's multi-step loop crashes on 2 replicas (placeholder not fed); step by step, a
    fit of 5 batches per epoch (the last one short and uneven) and an evaluate with the same
    executions end as plain Keras on one device with steps_per_execution=1."""
    import keras
    from keras.src.backend.tensorflow import trainer

    get("one_device")  # applies the fix (and splits nothing)
    assert getattr(trainer.TensorFlowTrainer._make_function, "_tfscale_step_by_step", False)
    rng = np.random.default_rng(0)
    x, y = rng.random((18, 4), dtype="float32"), rng.integers(0, 2, 18)

    def train(strategy, spe):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(keras.optimizers.Adam(0.01), loss, metrics=["accuracy"], steps_per_execution=spe)
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        return history, model.get_weights(), model.evaluate(x, y, batch_size=4, verbose=0)

    want = train(tf.distribute.get_strategy(), 1)
    got = train(get("mirrored", cpu_replicas=2), steps_per_execution)
    for key in want[0]:
        np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-6, atol=1e-6, err_msg=key)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-6)
