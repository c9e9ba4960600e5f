"""The generated equivalence harness: every model-parallel mode against plain Keras on one device.

A case is (mode, micro-batches M, data_parallel D, optimizer, optimizer option, layer
family, fit feature). Each case builds the same small model from the same seed twice:
once as plain Keras on one device (the reference), once through the mode under test,
trains both on the same data in the same order (16 samples, batches of 8, 2 epochs, no
shuffling) and compares what the feature exposes: per-epoch losses and metrics,
validation losses, `evaluate`, `predict`, the final weights in the unsplit model's
layout (`strategy.merge`, or the model itself for mirrored), the file `save_weights`
writes, `get_weights`/`set_weights`, the model `save` writes as `load_model` reads it back
(its weights, predictions, and one more epoch on it: the optimizer state came along), a
run interrupted mid-epoch and resumed by a new model from `tfscale.callbacks.BackupAndRestore`
(against the uninterrupted run), freeze / fit / unfreeze / compile / fit. Outcomes:

    EQUAL    every compared value within TOLERANCE of the reference;
    REFUSED  a `tfscale.Error` raised before the first step, its message one line, no
             weight of the user's model or of the mode's model changed;
    DIFFER   it ran and some value is off (the first such value and its size are kept);
    CRASH    anything else (another exception, a multi-line refusal, a refusal after
             weights changed);
    N/A      plain Keras itself rejects the combination (e.g. LearningRateScheduler with
             a LearningRateSchedule, class_weight with per-timestep targets): nothing to
             compare with; counted and reported, never a pass of the mode.

Only EQUAL, REFUSED and N/A pass.

Tiers (one process, 4 logical CPUs from tests/conftest.py, references shared by key):
    smoke     `pytest tests/test_equivalence.py -m "not slow"` (the suite's fast tier): the
              first pairwise case of each model-parallel mode, M and D, and of each value
              added later (ADDED), and the cases the harness once found
              (tests/test_equivalence.py REGRESSIONS; ~30 cases, ~2 min).
              They are pairwise cases themselves (one aside): a full run runs each once.
    pairwise  `pytest tests/test_equivalence.py -m slow` (in `.ci/run`): a pairwise cover,
              every pair of values of any two dimensions in at least one case (`pairwise`,
              fixed seed; 429 cases: the 267 of the first values, then 77, 17, 17, 34 and 17
              for the pairs of the values added later (ADDED_ROUNDS: issue 24's, `zb-v`, the
              `graph` family, the ZeRO stages, `rnn_dropout`), appended so that no earlier
              case changed (a
              cover made afresh would have 303); ~13 min on a quiet 2-core machine: too slow for the
              5-minute fast tier, measured, so it is the CI gate). Cases with a known open
              difference are strict xfails in tests/test_equivalence.py (`KNOWN`), each with
              its reason: one that starts to pass fails the run until it leaves the list.
    ci        `TFSCALE_EQUIVALENCE=ci pytest tests/test_equivalence.py -m slow`: a wider sample
              of the whole cross drawn with a fixed seed (CI_CASES cases, none pairwise).
    full      `TFSCALE_EQUIVALENCE=full pytest tests/test_equivalence.py -m slow`: the whole
              cross (hundreds of thousands of cases: select with `-k`, e.g. `-k "tensor and adam"`).
Table: `python tests/_equivalence.py [fast|ci|full] [--markdown FILE]` runs a tier and
prints the per-mode table (README "What each model-parallel mode supports exactly") and
every DIFFER/CRASH case with its size.

TOLERANCE: 1e-5 absolute plus 1e-5 relative, float32, for every compared value. No
looser tolerance is used: the modes reassociate sums (micro-batch losses, all-reduced
gradients), which moves results by ~1e-7 after 4 steps of these models.
MIXED_TOLERANCE (option mixed_float16 only): 1e-3 absolute plus 1e-3 relative, one
float16 rounding (2^-10 relative; 2^-11 at most in round-to-nearest): there the activations
and the per-micro-batch or per-copy gradients are float16, and a sum split in two parts is
rounded twice. Measured: up to ~1e-3 (pipeline M=1 D=2, Nesterov SGD). Its limit: a mode
computing some layers in float32 instead is within it too on these small models (a tensor
split whose shards lost the policy: 7e-4); a loss not scaled, or any float32 difference, is
not (pipeline without `scale_loss`: 0.05).
ADAPTIVE_MIXED_TOLERANCE (mixed_float16, a mode that cuts the batch (M > 1, D > 1, mirrored,
ZeRO), an optimizer whose update is not proportional to the gradient: all but the SGD
ones): 5e-3. Each part of a cut batch rounds its float16 activation gradients on its own
(~1e-5 absolute), and Adam-like optimizers divide a weight's moment by its root mean square
(Lion takes its sign): where a gradient stays near that rounding (~2e-4), the update moves by
a tenth of the learning rate. Measured on the graph family with Adam, AdamW and a loss-scaled
Adam: 0.0022 alike under mirrored, ZeRO-1, the layer split at D = 2 and every pipeline at
M = 2 on this AVX-512 machine (earlier CI machines stayed within 1e-3), while float32, and SGD in
float16, stay within their tolerances. Past mixed-precision bugs stay outside it: a loss not
scaled (0.05), a stage's fusion differing from Keras's under Adam (0.03, REGRESSIONS).
"""

import contextlib
import dataclasses
import itertools
import os
import random
import re
import sys
import tempfile
import time

import numpy as np

TOLERANCE = 1e-5
MIXED_TOLERANCE = 1e-3  # mixed_float16: float16 sums reassociated (module docstring)
ADAPTIVE_MIXED_TOLERANCE = 5e-3  # and the batch split, under an update not proportional to the gradient
_PROPORTIONAL = ("sgd", "sgd_momentum", "sgd_nesterov")  # updates proportional to the gradients
SEED = 7
CI_CASES = 60  # measured ~14 s a case on 2 cores shared by 8 jobs; ~4 s estimated quiet: ~4 min
BATCH, SAMPLES, EPOCHS = 8, 16, 2

PIPELINES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO = ("zero1", "zero2")  # mirrored with zero_stage=1 / 2 (issue 26)
REPLICATED = ("mirrored", *ZERO)  # TensorFlow's MirroredStrategy, 2 replicas: the model is not split
MODES = (*PIPELINES, "layer", "tensor", "mirrored", *ZERO)
OPTIMIZERS = (
    "sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax",
    "nadam", "ftrl", "lion", "adafactor", "lamb", "muon", "loss_scale",
)  # fmt: skip
OPTIONS = ("none", "clipnorm", "global_clipnorm", "clipvalue", "weight_decay", "ema", "lr_schedule",
           "accumulation", "exclude_weight_decay", "mixed_float16")  # fmt: skip
LAYERS = (
    "dense", "embedding_repeated", "embedding_mask_zero", "conv", "rnn_masked", "lstm_masked",
    "gru_timestep_masked", "bidirectional_masked", "attention", "batchnorm", "batchnorm_inference",
    "dropout", "frozen", "regularizers", "add_loss", "custom", "graph", "rnn_dropout", "augment",
)  # fmt: skip
FEATURES = (
    "fit", "sample_weight", "class_weight", "validation_data", "evaluate", "predict", "metrics",
    "metrics_masked", "steps_per_execution", "lr_callback", "uneven_numpy", "uneven_tf_data",
    "save_load_weights", "get_set_weights", "backup_resume", "freeze_unfreeze", "save_load_model",
)  # fmt: skip
DIMENSIONS = {
    "mode": MODES,
    "m": (1, 2),
    "dp": (1, 2),
    "optimizer": OPTIMIZERS,
    "option": OPTIONS,
    "layer": LAYERS,
    "feature": FEATURES,
}
# Values added after the cover was first run, in the order they came: the cover is the first
# values' cover, then for each round the cases its new pairs need, appended; so the cases
# already run keep their ids (and tests/test_equivalence.py's KNOWN its entries).
ADDED_ROUNDS = (
    {  # the model's life around fit, mixed precision (issue 24)
        "option": ("exclude_weight_decay", "mixed_float16"),
        "feature": ("backup_resume", "freeze_unfreeze", "save_load_model"),
    },
    {"mode": ("zb-v",)},  # the ZB-V schedule (issue 30)
    {"layer": ("graph",)},  # a functional graph, not a chain: the layer split cuts it (issue 25)
    {"mode": ZERO},  # ZeRO stages 1 and 2 on mirrored (issue 26)
    {"layer": ("rnn_dropout",)},  # an RNN's dropout / recurrent_dropout masks (issue 24)
    {"layer": ("augment",)},  # augmentation layers and keras.random in a custom layer (issue 24)
)
ADDED = {n: tuple(v for r in ADDED_ROUNDS for v in r.get(n, ())) for r in ADDED_ROUNDS for n in r}


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    m: int  # micro-batches (pipelines; 1 elsewhere)
    dp: int  # data_parallel copies (mirrored: its 2 replicas)
    optimizer: str
    option: str
    layer: str
    feature: str

    @property
    def id(self):
        return "-".join(map(str, dataclasses.astuple(self)))


def valid(assignment):
    """Whether a (partial) {dimension: value} assignment names a runnable configuration."""
    mode, m, dp = assignment.get("mode"), assignment.get("m"), assignment.get("dp")
    if mode in ("layer", "tensor", *REPLICATED) and m not in (None, 1):
        return False  # M is a pipeline's
    if mode == "interleaved" and m not in (None, 2):
        return False  # interleaved needs M a multiple of S = 2
    if mode in REPLICATED and dp not in (None, 2):
        return False  # cpu_replicas=2
    return True


def pairwise(dimensions=DIMENSIONS, seed=SEED, added=None):
    """A deterministic list of cases in which every valid pair of values of two dimensions occurs.

    The cover of the values in no round of `added` (default ADDED_ROUNDS; one {dimension:
    values} or a sequence of them), then, round by round, the cases the round's new pairs
    need, appended: a value added later changes no case already run.
    """
    rounds = ADDED_ROUNDS if added is None else (added,) if isinstance(added, dict) else tuple(added)

    def without(later):
        return {
            n: tuple(v for v in values if not any(v in r.get(n, ()) for r in later))
            for n, values in dimensions.items()
        }

    cases = _greedy(without(rounds), seed)
    for i in range(len(rounds)):
        cases = _greedy(without(rounds[i + 1 :]), seed, cases)
    return cases


def _greedy(dimensions, seed, start=()):
    """Greedy (AETG-like): each new case starts from an uncovered pair (none covered by
    `start`, the cases it extends) and fills the other dimensions, in a seeded order, with
    the value covering most uncovered pairs."""
    rng = random.Random(seed)
    names = list(dimensions)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in dimensions[a]
        for vb in dimensions[b]
        if valid({a: va, b: vb})
    }
    cases, used = list(start), {(n, v): 0 for n in names for v in dimensions[n]}
    for case in cases:
        for name in names:
            used[name, getattr(case, name)] += 1
        uncovered -= {_pair(x, getattr(case, x), y, getattr(case, y), names)
                      for x, y in itertools.combinations(names, 2)}  # fmt: skip
    while uncovered:
        (a, va), (b, vb) = rng.choice(sorted(uncovered, key=repr))
        chosen = {a: va, b: vb}
        rest = [n for n in names if n not in chosen]
        rng.shuffle(rest)
        for name in rest:
            # Most new pairs first; among equals the value used least so far (spreads the cost).
            scored = [
                (-sum(_pair(name, value, o, ov, names) in uncovered for o, ov in chosen.items()),
                 used[name, value], rng.random(), value)
                for value in dimensions[name]
                if valid({**chosen, name: value})
            ]  # fmt: skip
            chosen[name] = min(scored, key=lambda s: s[:3])[3]
        for name, value in chosen.items():
            used[name, value] += 1
        uncovered -= {_pair(x, chosen[x], y, chosen[y], names) for x, y in itertools.combinations(names, 2)}
        cases.append(Case(**chosen))
    return cases


def _pair(a, va, b, vb, names):
    return ((a, va), (b, vb)) if names.index(a) < names.index(b) else ((b, vb), (a, va))


def full_cross(dimensions=DIMENSIONS):
    names = list(dimensions)
    for values in itertools.product(*(dimensions[n] for n in names)):
        assignment = dict(zip(names, values))
        if valid(assignment):
            yield Case(**assignment)


def tier_cases(tier):
    """The cases of a tier: "smoke" (one pairwise case per mode, M and D), "fast" (the
    pairwise cover), "ci" (a seeded sample beside it) or "full"."""
    fast = pairwise()
    if tier == "fast":
        return fast
    if tier == "smoke":
        first = {}
        for case in fast:
            if case.mode != "mirrored":  # the reference mode: in the pairwise tier
                first.setdefault((case.mode, case.m, case.dp), case)
                # And each value added later (ADDED), so that a break of it shows here too.
                for name, values in ADDED.items():
                    if getattr(case, name) in values:
                        first.setdefault((name, getattr(case, name)), case)
        return list(dict.fromkeys(first.values()))
    if tier == "full":
        return list(full_cross())
    if tier != "ci":
        raise ValueError(f"Unknown tier {tier!r}: expected 'fast', 'ci' or 'full'.")
    rng, seen, cases = random.Random(SEED + 1), set(fast), []
    # Sampled dimension by dimension (the cross has ~10^6 members): uniform over valid cases.
    while len(cases) < CI_CASES:
        case = {n: rng.choice(v) for n, v in DIMENSIONS.items()}
        if valid(case) and Case(**case) not in seen:
            seen.add(Case(**case))
            cases.append(Case(**case))
    return cases


# ---------------------------------------------------------------- models and data


def _custom_layers():
    import keras

    class ActivityPenalty(keras.layers.Layer):
        """Adds 0.01 x mean(x^2) to the loss from `call` (`add_loss`)."""

        def call(self, x):
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
            return x

    class Scale(keras.layers.Layer):
        """A custom layer with its own weight made in `build`."""

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

        def call(self, x):
            return x * self.scale

    class SelfAttention(keras.layers.Layer):
        """MultiHeadAttention on one input (a chain link: the model stays a chain).

        Without biases: the key bias's gradient is exactly zero in exact arithmetic (it
        shifts every logit of a query alike), so what is computed is round-off noise, and
        Adam-like optimizers normalise that noise into learning-rate-sized steps of random
        sign: a difference that reassociation explains, not the mode.
        """

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=2, use_bias=False)

        def call(self, x):
            return self.attention(x, x)

    class Jitter(keras.layers.Layer):
        """A user's own random layer: `keras.random.normal` from its own SeedGenerator, in training."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.noise = keras.random.SeedGenerator()

        def call(self, x, training=False):
            if not training:
                return x
            return x + 0.3 * keras.random.normal(keras.ops.shape(x), seed=self.noise, dtype=x.dtype)

    return ActivityPenalty, Scale, SelfAttention, Jitter


def _functional(*links, kwargs=None):
    """A functional chain: `links` called in turn (layers or raw ops); kwargs per link index."""
    import keras

    inputs = x = links[0]
    for i, link in enumerate(links[1:], 1):
        x = link(x, **(kwargs or {}).get(i, {}))
    return keras.Model(inputs, x)


def _graph():
    """A functional graph, not a chain: a residual over two layers, a raw op on the input
    feeding a late layer (skips across the layer split's cut), a merge of two branches."""
    import keras

    L = keras.layers
    x = keras.Input((4,))
    a = L.Dense(8, "tanh")(x)
    h = L.Add()([a, L.Dense(8, "tanh")(L.Dense(8, "tanh")(a))])
    d = L.Dense(4, "tanh")(L.Concatenate()([h, keras.ops.tanh(x)]))
    return keras.Model(x, L.Dense(2)(d))


def _families():
    """{layer family: a function building its model} (small chains of a few hundred params)."""
    import keras

    L, In, seq = keras.layers, keras.Input, keras.Sequential
    ActivityPenalty, Scale, SelfAttention, Jitter = _custom_layers()
    l2, l1 = keras.regularizers.L2(0.01), keras.regularizers.L1(0.01)
    ids = {"dtype": "int32"}
    return {
        "dense": lambda: seq([In((4,)), L.Dense(8, "tanh"), L.Dense(8, "tanh"), L.Dense(4, "tanh"),
                              L.Dense(2)]),
        "embedding_repeated": lambda: seq([In((6,), **ids), L.Embedding(6, 4), L.GlobalAveragePooling1D(),
                                           L.Dense(4, "tanh"), L.Dense(2)]),
        "embedding_mask_zero": lambda: seq([In((6,), **ids), L.Embedding(8, 4, mask_zero=True), L.LSTM(4),
                                            L.Dense(4, "tanh"), L.Dense(2)]),
        "conv": lambda: seq([In((6, 6, 1)), L.Conv2D(2, 3, activation="tanh"), L.Conv2D(2, 3), L.Flatten(),
                             L.Dense(2)]),
        "rnn_masked": lambda: seq([In((5, 3)), L.Masking(), L.SimpleRNN(4), L.Dense(4, "tanh"), L.Dense(2)]),
        "lstm_masked": lambda: seq([In((5, 3)), L.Masking(), L.Dense(4), L.LSTM(4), L.Dense(2)]),
        "gru_timestep_masked": lambda: seq([In((6,), **ids), L.Embedding(8, 4, mask_zero=True),
                                            L.GRU(4, return_sequences=True), L.Dense(4, "tanh"), L.Dense(2)]),
        "bidirectional_masked": lambda: seq([In((6,), **ids), L.Embedding(8, 4, mask_zero=True),
                                             L.Bidirectional(L.LSTM(2)), L.Dense(4, "tanh"), L.Dense(2)]),
        "attention": lambda: seq([In((5, 4)), L.Dense(4), SelfAttention(), L.GlobalAveragePooling1D(),
                                  L.Dense(2)]),
        # No bias before BatchNormalization: it removes the mean, so that bias's true gradient
        # is zero and its round-off noise (~1e-8) becomes a full step under Adam-like updates.
        "batchnorm": lambda: seq([In((4,)), L.Dense(8, use_bias=False), L.BatchNormalization(),
                                  L.Activation("tanh"), L.Dense(2)]),
        # A functional chain calling BatchNormalization(training=False) (inference mode in fit).
        "batchnorm_inference": lambda: _functional(In((4,)), L.Dense(8, use_bias=False),
                                                   L.BatchNormalization(), L.Dense(4, "tanh"), L.Dense(2),
                                                   kwargs={2: {"training": False}}),
        "dropout": lambda: seq([In((4,)), L.Dense(8, "tanh"), L.Dropout(0.5), L.Dense(4, "tanh"),
                                L.Dense(2)]),
        "frozen": lambda: seq([In((4,)), L.Dense(8, "tanh", trainable=False), L.Dense(4, "tanh"),
                               L.Dense(2)]),
        "regularizers": lambda: seq([In((4,)), L.Dense(8, "tanh", kernel_regularizer=l2, bias_regularizer=l1),
                                     L.Dense(4, "tanh"), L.Dense(2, kernel_regularizer=l2)]),
        "add_loss": lambda: seq([In((4,)), L.Dense(8, "tanh"), ActivityPenalty(), L.Dense(4, "tanh"),
                                 L.Dense(2)]),
        # A raw keras.ops call between layers and a custom layer with its own weight.
        "custom": lambda: _functional(In((4,)), L.Dense(8), keras.ops.tanh, Scale(), L.Dense(4, "tanh"),
                                      L.Dense(2)),
        "graph": _graph,
        # The cell draws its input and recurrent masks (DropoutRNNCell), not a Dropout layer.
        "rnn_dropout": lambda: seq([In((5, 3)), L.Dense(4), L.LSTM(4, dropout=0.4, recurrent_dropout=0.3),
                                    L.Dense(4, "tanh"), L.Dense(2)]),
        # Image augmentation (a draw per image) and a user's layer drawing keras.random.normal.
        "augment": lambda: seq([In((6, 6, 1)), L.RandomFlip("horizontal"), L.RandomTranslation(0.2, 0.2),
                                L.Conv2D(2, 3, activation="tanh"), Jitter(), L.Flatten(), L.Dense(2)]),
    }  # fmt: skip


def build_model(layer):
    """The model of a layer family, built from the global seed (set by the caller)."""
    return _families()[layer]()


def make_data(layer, samples, seed):
    """(x, y) for a layer family: y are 2 classes, per time step for per-timestep models."""
    rng = np.random.RandomState(seed)
    if layer == "embedding_repeated":
        x = rng.randint(0, 3, (samples, 6)).astype("int32")  # tokens repeat within every batch
    elif layer in ("embedding_mask_zero", "gru_timestep_masked", "bidirectional_masked"):
        x = rng.randint(1, 8, (samples, 6)).astype("int32")
        lengths = rng.randint(2, 7, samples)
        x[np.arange(6)[None, :] >= lengths[:, None]] = 0  # trailing padding
    elif layer in ("conv", "augment"):
        x = rng.randn(samples, 6, 6, 1).astype("float32")
    elif layer in ("rnn_masked", "lstm_masked", "attention", "rnn_dropout"):
        x = rng.randn(samples, 5, 3 if layer != "attention" else 4).astype("float32")
        if layer in ("rnn_masked", "lstm_masked"):
            lengths = rng.randint(2, 6, samples)
            x[np.arange(5)[None, :] >= lengths[:, None]] = 0.0  # masked time steps
    else:
        x = rng.randn(samples, 4).astype("float32")
    shape = (samples, 6) if layer == "gru_timestep_masked" else (samples,)
    return x, rng.randint(0, 2, shape).astype("int32")


_LEARNING_RATES = {"sgd": 0.1, "sgd_momentum": 0.1, "sgd_nesterov": 0.1, "adadelta": 0.5, "ftrl": 0.1}
_OPTION_KWARGS = {
    "none": {},
    "clipnorm": {"clipnorm": 0.05},
    "global_clipnorm": {"global_clipnorm": 0.05},
    "clipvalue": {"clipvalue": 0.005},
    "weight_decay": {"weight_decay": 0.1},
    "ema": {"use_ema": True, "ema_momentum": 0.5},
    "accumulation": {"gradient_accumulation_steps": 2},
    "exclude_weight_decay": {"weight_decay": 0.1},  # and exclusions, made in `_compile`
    "mixed_float16": {},  # a global dtype policy (`precision`); compile wraps a LossScaleOptimizer
}


def make_optimizer(name, option):
    import keras

    opt = keras.optimizers
    lr = _LEARNING_RATES.get(name, 0.02)
    if option == "lr_schedule":
        kwargs = {"learning_rate": opt.schedules.ExponentialDecay(lr, decay_steps=1, decay_rate=0.7)}
    else:
        kwargs = {"learning_rate": lr, **_OPTION_KWARGS[option]}
    if name == "loss_scale":
        return opt.LossScaleOptimizer(opt.Adam(**kwargs))
    classes = {
        "sgd": opt.SGD, "adam": opt.Adam, "adamw": opt.AdamW, "rmsprop": opt.RMSprop, "adagrad": opt.Adagrad,
        "adadelta": opt.Adadelta, "adamax": opt.Adamax, "nadam": opt.Nadam, "ftrl": opt.Ftrl,
        "lion": opt.Lion, "adafactor": opt.Adafactor, "lamb": opt.Lamb, "muon": opt.Muon,
    }  # fmt: skip
    if name == "sgd_momentum":
        return opt.SGD(momentum=0.9, **kwargs)
    if name == "sgd_nesterov":
        return opt.SGD(momentum=0.9, nesterov=True, **kwargs)
    return classes[name](**kwargs)


# ---------------------------------------------------------------- one run (reference or mode)


def _compile(model, case):
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metrics = weighted = None
    if case.feature == "metrics":
        metrics = [keras.metrics.SparseCategoricalAccuracy(), keras.metrics.SparseCategoricalCrossentropy(
            from_logits=True)]  # fmt: skip
    if case.feature == "metrics_masked":
        weighted = [keras.metrics.SparseCategoricalAccuracy()]
    model.compile(
        optimizer=make_optimizer(case.optimizer, case.option),
        loss=loss,
        metrics=metrics,
        weighted_metrics=weighted,
        steps_per_execution=2 if case.feature == "steps_per_execution" else 1,
    )
    if case.option == "exclude_weight_decay":  # one layer's variables and every bias
        model.optimizer.exclude_from_weight_decay(
            var_list=_first_weighted_layer(model).trainable_weights, var_names=["bias"]
        )


def _first_weighted_layer(model):
    """The model's first layer with weights (through `get_layer`: the user's layer in a split)."""
    for index in itertools.count():
        layer = model.get_layer(index=index)
        if layer.weights:
            return layer


def _fit_arguments(case, x, y):
    """(args, kwargs) of `fit` for the case's feature."""
    import keras
    import tensorflow as tf

    kwargs = {"epochs": EPOCHS, "shuffle": False, "verbose": 0}
    if case.feature == "uneven_tf_data":
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),), kwargs
    kwargs["batch_size"] = BATCH
    if case.feature in ("sample_weight", "metrics_masked"):
        kwargs["sample_weight"] = np.linspace(0.5, 2.0, len(x)).astype("float32")
    elif case.feature == "class_weight":
        kwargs["class_weight"] = {0: 1.0, 1: 3.0}
    elif case.feature == "validation_data":
        kwargs["validation_data"] = make_data(case.layer, BATCH, seed=2)
    elif case.feature == "lr_callback":
        kwargs["callbacks"] = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)]
    return (x, y), kwargs


class _Interrupted(Exception):
    """Raised by `_Interrupt`: the job stopped mid-epoch (backup_resume)."""


def _interrupt_at(step):
    import keras

    class Interrupt(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_begin(self, batch, logs=None):
            if self.steps == step:
                raise _Interrupted(f"interrupted before step {step}")
            self.steps += 1

    return Interrupt()


def _train(model, merged, case, args, kwargs, files, respawn):
    """`fit` as the feature asks: (the model trained, its `merged`, the history)."""
    if case.feature == "freeze_unfreeze":  # Keras's fine-tuning recipe, one epoch each
        layer = _first_weighted_layer(model)
        layer.trainable = False
        first = model.fit(*args, **{**kwargs, "epochs": 1}).history
        layer.trainable = True
        _compile(model, case)
        second = model.fit(*args, **{**kwargs, "epochs": 1}).history
        return model, merged, {k: first[k] + second[k] for k in first}
    if case.feature == "backup_resume" and respawn is not None:
        from tfscale import callbacks

        # Stopped before the second step of the first epoch (backed up after every step),
        # then a new job's model resumes: every epoch's loss and metrics (the interrupted
        # one's too: the backup holds its metric state) and the weights must be the
        # uninterrupted run's.
        backup = callbacks.BackupAndRestore(os.path.join(files, "backup"), save_freq=1)
        try:
            model.fit(*args, **{**kwargs, "callbacks": [backup, _interrupt_at(1)]})
            raise AssertionError("the interruption did not happen")
        except _Interrupted:
            pass
        model, merged = respawn()
        _compile(model, case)
        return model, merged, model.fit(*args, **{**kwargs, "callbacks": [backup]}).history
    return model, merged, model.fit(*args, **kwargs).history


def run(model, case, merged, *, files, rebuild, respawn=None):
    """Trains `model` for the case and returns {name: value} of what the feature exposes.

    `merged()` gives the model in the unsplit layout after training; `files` is a folder
    for weights files; `rebuild()` a fresh plain model (to load a written file into);
    `respawn()` a fresh (model, merged) of the same mode: the job restarted after an
    interruption (backup_resume; None for the reference, which runs uninterrupted).
    """
    import keras

    samples = SAMPLES + 3 if case.feature.startswith("uneven") else SAMPLES
    x, y = make_data(case.layer, samples, seed=1)
    _compile(model, case)
    args, kwargs = _fit_arguments(case, x, y)
    model, merged, history = _train(model, merged, case, args, kwargs, files, respawn)
    out = {f"history.{k}": np.asarray(v) for k, v in sorted(history.items()) if k != "learning_rate"}
    out["weights"] = [np.asarray(w) for w in merged().get_weights()]
    xv, yv = make_data(case.layer, BATCH, seed=3)
    if case.feature == "evaluate":
        out["evaluate"] = np.asarray(model.evaluate(xv, yv, batch_size=BATCH, verbose=0))
    if case.feature in ("predict", "backup_resume", "freeze_unfreeze"):
        out["predict"] = model.predict(xv, batch_size=BATCH, verbose=0)
    if case.feature == "save_load_weights":
        path = os.path.join(files, "trained.weights.h5")
        model.save_weights(path)
        fresh = rebuild()
        fresh.load_weights(path)
        out["file_loaded_into_plain_model"] = fresh.get_weights()
        model.load_weights(os.path.join(files, "..", "reference", "trained.weights.h5"))
        out["predict_after_load_weights"] = model.predict(xv, batch_size=BATCH, verbose=0)
    if case.feature == "get_set_weights":
        out["get_weights"] = [np.asarray(w) for w in model.get_weights()]
        model.set_weights([w * 0.5 for w in out["get_weights"]])
        out["predict_after_set_weights"] = model.predict(xv, batch_size=BATCH, verbose=0)
    if case.feature == "save_load_model":  # the whole model: architecture, weights, optimizer
        path = os.path.join(files, "trained.keras")
        model.save(path)
        # Keras saves no seed-generator state: a loaded Dropout draws from a fresh seed taken
        # from the global RNG, which a mode that built more models has moved further.
        keras.utils.set_random_seed(SEED)
        loaded = keras.models.load_model(path, custom_objects={c.__name__: c for c in _custom_layers()})
        out["loaded.weights"] = [np.asarray(w) for w in loaded.get_weights()]
        out["loaded.predict"] = loaded.predict(xv, batch_size=BATCH, verbose=0)
        # It continues as the saved model would: the optimizer's state came with it.
        out["loaded.history.loss"] = np.asarray(loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                                           verbose=0).history["loss"])  # fmt: skip
        out["loaded.trained_weights"] = [np.asarray(w) for w in loaded.get_weights()]
    return out


@contextlib.contextmanager
def precision(case):
    """The case's global dtype policy (mixed_float16), the previous one restored after."""
    import keras

    if case.option != "mixed_float16":
        yield
        return
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    _POLICY["name"] = "mixed_float16"
    try:
        yield
    finally:
        _POLICY["name"] = None
        keras.mixed_precision.set_global_policy(before)


_POLICY = {"name": None}  # the global dtype policy `precision` set (`clear_session` resets it)


# ---------------------------------------------------------------- modes


def _strategy(case):
    from tfscale import strategies

    if case.mode in PIPELINES:
        return strategies.get(
            "pipeline",
            num_stages=2,
            num_microbatches=case.m,
            schedule=case.mode,
            virtual_stages=2 if case.mode in ("interleaved", "zb-v") else 1,
            data_parallel=case.dp,
        )
    if case.mode in REPLICATED:
        return strategies.get(
            "mirrored", cpu_replicas=2, zero_stage=ZERO.index(case.mode) + 1 if case.mode in ZERO else 0
        )
    return strategies.get(
        "model_split", num_devices=2, tensor_parallel=case.mode == "tensor", data_parallel=case.dp
    )


def _fresh(layer):
    import keras

    keras.utils.set_random_seed(SEED)
    return build_model(layer)


@dataclasses.dataclass
class Outcome:
    case: Case
    outcome: str  # EQUAL REFUSED DIFFER CRASH N/A
    detail: str = ""
    size: float = 0.0


_REFERENCES = {}


def reference(case, root):
    """Plain Keras on one device for the case, shared by every case that trains the same."""
    key = (case.optimizer, case.option, case.layer, case.feature)
    if key not in _REFERENCES:
        files = os.path.join(root, "reference")
        os.makedirs(files, exist_ok=True)
        _clear()
        try:
            model = _fresh(case.layer)
            # (save_load_weights: the mode loads the file this run writes, root/reference/.)
            _REFERENCES[key] = run(
                model, case, lambda: model, files=files, rebuild=lambda: _fresh(case.layer)
            )
        except Exception as e:  # plain Keras rejects the combination: N/A
            _REFERENCES[key] = f"{type(e).__name__}: {_first_line(e)}"
    return _REFERENCES[key]


def _clear():
    import keras

    # Keras's default also runs a full garbage collection: 0.2 s a call on this heap, ~15% of
    # a case. Reference counting frees the last case's models; no test here needs more.
    keras.backend.clear_session(free_memory=False)
    if _POLICY["name"] is not None:
        keras.mixed_precision.set_global_policy(_POLICY["name"])


def _first_line(error):
    """One line for a report: TensorFlow's "Graph execution error:" is followed by its cause."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if len(lines) > 1 and lines[0].endswith(":"):
        causes = [line for line in lines[1:] if not line.startswith(("File ", "Detected at node", "["))]
        return f"{lines[0]} {causes[-1] if causes else lines[-1]}"[:300]
    return lines[0][:300]


def run_case(case, tamper=None):
    """Runs one case against its reference; `tamper(stage, model)` breaks it on purpose (tests)."""
    with precision(case):
        return _run_case(case, tamper)


def _run_case(case, tamper):
    from tfscale import errors

    root = tempfile.mkdtemp(prefix="tfscale-eq-")
    if case.feature == "save_load_weights":
        _REFERENCES.pop((case.optimizer, case.option, case.layer, case.feature), None)  # its file is per root
    ref = reference(case, root)
    if isinstance(ref, str):
        return Outcome(case, "N/A", f"plain Keras: {ref}")
    _clear()
    user = _fresh(case.layer)
    user_before = user.get_weights()
    model, before, steps = None, None, []
    try:
        strategy = _strategy(case)
        if case.mode in REPLICATED:
            with strategy.scope():
                model = _fresh(case.layer)
            scope, merged = strategy.scope, lambda: model
        else:
            model = strategy.split(user)
            scope, merged = contextlib.nullcontext, lambda: strategy.merge(model)
        before = model.get_weights()

        def respawn():  # a restarted job: the same mode, a new model from the seed
            if case.mode in REPLICATED:
                with strategy.scope():
                    again = _fresh(case.layer)
                return _Watched(again, tamper, lambda: steps.append(1)), lambda: again
            again = strategy.split(_fresh(case.layer))
            return _Watched(again, tamper, lambda: steps.append(1)), lambda: strategy.merge(again)

        if tamper:
            tamper("split", model)
        files = os.path.join(root, "mode")
        os.makedirs(files)
        with scope():
            got = run(
                _Watched(model, tamper, lambda: steps.append(1)),
                case,
                merged,
                files=files,
                rebuild=lambda: _fresh(case.layer),
                respawn=respawn,
            )
    except errors.Error as e:
        text = str(e)
        changed = _changed(user_before, user.get_weights()) or (
            model is not None and before is not None and _changed(before, model.get_weights())
        )
        if "\n" in text.strip():
            return Outcome(case, "CRASH", f"refusal not one line: {type(e).__name__}: {_first_line(e)}")
        if changed or steps:
            return Outcome(case, "CRASH", f"refused after weights changed: {type(e).__name__}: {text[:200]}")
        return Outcome(case, "REFUSED", f"{type(e).__name__}: {text[:300]}")
    except Exception as e:  # the outcome names it
        return Outcome(case, "CRASH", f"{type(e).__name__}: {_first_line(e)}")
    return compare(case, ref, got)


class _Watched:
    """The model, with `fit` watched: a tamper hook after it, and a note that steps ran."""

    def __init__(self, model, tamper, on_fit):
        self._model, self._tamper, self._on_fit = model, tamper, on_fit

    def __getattr__(self, name):
        return getattr(self._model, name)

    def fit(self, *args, **kwargs):
        import keras

        on_fit = self._on_fit

        class Stepped(keras.callbacks.Callback):
            def on_train_batch_end(_, batch, logs=None):
                on_fit()

        kwargs["callbacks"] = [*kwargs.get("callbacks", []), Stepped()]
        history = self._model.fit(*args, **kwargs)
        if self._tamper:
            self._tamper("fit", self._model)
        return history


def _changed(before, after):
    return len(before) != len(after) or any(
        a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(before, after)
    )


def tolerance(case):
    if case.option != "mixed_float16":
        return TOLERANCE
    splits = case.m > 1 or case.dp > 1 or case.mode in REPLICATED
    return ADAPTIVE_MIXED_TOLERANCE if splits and case.optimizer not in _PROPORTIONAL else MIXED_TOLERANCE


def compare(case, ref, got):
    """EQUAL, or DIFFER naming the first value off and by how much."""
    tol, largest = tolerance(case), 0.0
    for key in ref:
        if key not in got:
            return Outcome(case, "DIFFER", f"{key}: missing (got {sorted(got)})", float("inf"))
        a, b = ref[key], got[key]
        if isinstance(a, list):
            if len(a) != len(b) or any(np.shape(x) != np.shape(z) for x, z in zip(a, b)):
                return Outcome(case, "DIFFER", f"{key}: layout {[np.shape(z) for z in b]} "
                               f"instead of {[np.shape(x) for x in a]}", float("inf"))  # fmt: skip
            pairs = list(zip(a, b))
        else:
            if np.shape(a) != np.shape(b):
                return Outcome(
                    case, "DIFFER", f"{key}: shape {np.shape(b)} instead of {np.shape(a)}", float("inf")
                )
            pairs = [(a, b)]
        for i, (want, have) in enumerate(pairs):
            x, z = np.asarray(want, dtype="float64"), np.asarray(have, dtype="float64")
            excess = np.abs(x - z) - (tol + tol * np.abs(x))
            if np.all(np.isfinite(x)) and np.all(np.isfinite(z)) and x.size:
                largest = max(largest, float(np.max(np.abs(x - z))))
            if np.any(excess > 0) or not np.all(np.isfinite(z) == np.isfinite(x)):
                size = float(np.nanmax(np.abs(x - z)))
                where = f"[{i}]" if len(pairs) > 1 else ""
                return Outcome(case, "DIFFER", f"{key}{where} off by {size:.2g}", size)
    return Outcome(case, "EQUAL", size=largest)  # the largest difference seen, within tolerance


BASELINE = {"m": 1, "dp": 1, "optimizer": "sgd", "option": "none", "layer": "dense", "feature": "fit"}


def minimize(case, run=None):
    """The smallest case failing like `case`: each dimension reset to BASELINE where it still fails.

    A failing case varies several dimensions at once; this names the ones that matter
    (what a minimal reproducer needs). Returns (minimal case, its outcome).
    """
    run = run or run_case
    outcome = run(case)
    if outcome.outcome not in ("DIFFER", "CRASH"):
        return case, outcome
    for name, value in BASELINE.items():
        trial = dataclasses.replace(case, **{name: value})
        if trial == case or not valid(vars(trial)):
            continue
        tried = run(trial)
        if tried.outcome == outcome.outcome:
            case, outcome = trial, tried
    return case, outcome


# ---------------------------------------------------------------- the table


FAMILIES = {"optimizer": OPTIMIZERS, "option": OPTIONS, "layer": LAYERS, "feature": FEATURES}


def mode_label(case):
    if case.mode in PIPELINES:
        return f"pipeline {case.mode} M={case.m} D={case.dp}"
    if case.mode == "mirrored":
        return "mirrored (2 replicas, reference)"
    if case.mode in ZERO:
        return f"mirrored zero_stage={case.mode[-1]} (2 replicas)"
    return f"{case.mode} split D={case.dp}"


def table(outcomes):
    """Markdown: per mode, the outcome counts; the values never seen exact, and those refused."""
    kinds = ("EQUAL", "REFUSED", "DIFFER", "CRASH", "N/A")
    rows = {}
    for o in outcomes:
        rows.setdefault(mode_label(o.case), []).append(o)
    lines = [
        "| mode | cases | " + " | ".join(kinds) + " | in a failing case, never in an equal one | refused |",
        "|---|---:|" + "---:|" * len(kinds) + "---|---|",
    ]
    for label in sorted(rows):
        group = rows[label]
        counts = [sum(o.outcome == k for o in group) for k in kinds]
        by_kind = {k: set() for k in kinds}
        for o in group:
            values = {o.case.optimizer, o.case.option, o.case.layer, o.case.feature} - {"none", "fit"}
            by_kind[o.outcome] |= values
        never = (by_kind["DIFFER"] | by_kind["CRASH"]) - by_kind["EQUAL"]
        refused = by_kind["REFUSED"] - by_kind["EQUAL"]
        lines.append(
            f"| {label} | {len(group)} | " + " | ".join(map(str, counts))
            + f" | {', '.join(sorted(never)) or '-'} | {', '.join(sorted(refused)) or '-'} |"
        )  # fmt: skip
    return "\n".join(lines)


def failures(outcomes):
    """DIFFER/CRASH cases grouped by their message with numbers taken out, smallest case first."""
    groups = {}
    for o in outcomes:
        if o.outcome in ("DIFFER", "CRASH"):
            cause = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", o.detail)
            groups.setdefault((o.outcome, cause), []).append(o)
    lines = []
    for (kind, cause), group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        sizes = [o.size for o in group]
        lines.append(f"{kind} x{len(group)} {cause}  (size {min(sizes):.2g}..{max(sizes):.2g})")
        for o in group[:6]:
            lines.append(f"    {o.case.id}: {o.detail}")
    return "\n".join(lines)


_LINE = re.compile(r"^\[\d+/\d+ \d+s\] (EQUAL|REFUSED|DIFFER|CRASH|N/A) +(\S+) ?(.*)$")


def outcomes_from_log(path):
    """The outcomes printed by a run of `main` (to redo the table without running again)."""
    outcomes = []
    with open(path) as f:
        for line in f:
            match = _LINE.match(line.rstrip("\n"))
            if match:
                kind, case_id, detail = match.groups()
                size = re.search(r"off by (\S+)$", detail)
                outcomes.append(
                    Outcome(_parse_id(case_id), kind, detail, float(size.group(1)) if size else 0.0)
                )
    return outcomes


def _parse_id(case_id):
    """The Case of a `Case.id` (a mode may have a dash: "zb-h1", "zb-v")."""
    head = next(
        (mode for mode in MODES if "-" in mode and case_id.startswith(mode + "-")), case_id.split("-")[0]
    )
    m, dp, *rest = case_id[len(head) + 1 :].split("-")
    return Case(head, int(m), int(dp), *rest)


def main(argv):
    """`python tests/_equivalence.py [fast|ci|full] [--markdown FILE] [--from-log LOG]`."""
    if "--from-log" in argv:
        outcomes = outcomes_from_log(argv[argv.index("--from-log") + 1])
        text = table(outcomes)
        print(f"{len(outcomes)} cases\n\n{text}\n\n{failures(outcomes)}")
        if "--markdown" in argv:
            with open(argv[argv.index("--markdown") + 1], "w") as f:
                f.write(text + "\n")
        return 0
    if "--minimize" in argv:  # the case ids after it, e.g. from a red CI run
        for case_id in argv[argv.index("--minimize") + 1 :]:
            small, outcome = minimize(_parse_id(case_id))
            print(f"{case_id} -> {small.id}: {outcome.outcome} {outcome.detail}", flush=True)
        return 0
    tier = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "fast"
    from tfscale import strategies

    strategies.split_cpu(4)  # as tests/conftest.py
    cases = tier_cases(tier)
    pattern = os.environ.get("TFSCALE_EQUIVALENCE_K")
    if pattern:
        cases = [c for c in cases if re.search(pattern, c.id)]
    start, outcomes = time.time(), []
    for i, case in enumerate(cases):
        outcomes.append(run_case(case))
        o = outcomes[-1]
        print(
            f"[{i + 1}/{len(cases)} {time.time() - start:.0f}s] {o.outcome:7} {case.id} {o.detail}",
            flush=True,
        )
    text = table(outcomes)
    print(f"\n{tier}: {len(cases)} cases in {time.time() - start:.0f} s\n\n{text}\n\n{failures(outcomes)}")
    if "--markdown" in argv:
        with open(argv[argv.index("--markdown") + 1], "w") as f:
            f.write(text + "\n")
    return int(any(o.outcome in ("DIFFER", "CRASH") for o in outcomes))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main(sys.argv))
