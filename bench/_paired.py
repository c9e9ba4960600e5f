"""Paired rounds: the bench method every end-to-end figure here uses.

A shared machine drifts by tens of percent between minutes, so two variants timed minutes
apart cannot be compared, and best-of-N of unpaired runs does not remove the drift. Here
every round runs every variant once, one after the other, and each figure is the ratio of
a variant's value to its own round's baseline value; the median over rounds is reported
with its spread (min, max). An A/A control (the baseline run a second time in each round,
as its own variant) shows how far two identical runs differ on this machine at that time:
a variant's cost is only meaningful beyond the control's spread.

The order inside a round changes from round to round (rotated by one every two rounds,
reversed on odd rounds), so over 2n rounds of n variants each variant sits in each
position exactly twice and no variant always follows the same one (a warm cache, a
background write still finishing).

    from bench import _paired  # or `import _paired` from a script in bench/
    result = _paired.run({"none": fit_none, "async": fit_async}, baseline="none", rounds=6)
    print(_paired.format_table(result))

No TensorFlow here: the measured callables bring it.
"""

import os
import statistics
import time

__all__ = ["CONTROL", "beyond_control", "format_table", "order", "run", "summarize"]

CONTROL = "A/A control"


def order(labels, round_index):
    """The variants' order in round `round_index`: rotated by `round_index // 2`, reversed when odd."""
    labels = list(labels)
    shift = (round_index // 2) % len(labels)
    rotated = labels[shift:] + labels[:shift]
    return rotated[::-1] if round_index % 2 else rotated


def _load():
    try:
        return list(os.getloadavg())
    except OSError:  # not available on this platform
        return None


def run(variants, *, baseline, rounds, control=True, warmup=0, log=None):
    """Runs `variants` in paired rounds and summarizes them against `baseline`.

    Args:
      variants: dict label -> callable taking no argument and returning either a positive
        number (the value compared: seconds, or steps/s) or a dict with that number under
        "value" and any other measurements (kept per round, summarized by median).
      baseline: the label each round's values are divided by.
      rounds: measured rounds (each runs every variant once).
      control: add the baseline a second time per round as `CONTROL`.
      warmup: rounds run first and not counted (tracing, caches).
      log: optional callable(str) told each measurement as it comes.

    Returns:
      The dict `summarize` returns, with the load average at start and end.
    """
    if baseline not in variants:
        raise ValueError(f"`baseline` must be one of {sorted(variants)}. Received: baseline={baseline!r}")
    if rounds < 1:
        raise ValueError(f"`rounds` must be >= 1. Received: rounds={rounds}")
    variants = dict(variants)
    if control:
        variants[CONTROL] = variants[baseline]
    load_start, started = _load(), time.time()
    measured = []
    for index in range(warmup + rounds):
        values = {}
        for label in order(variants, index):
            result = variants[label]()
            values[label] = result if isinstance(result, dict) else {"value": result}
            if log:
                counted = "warm-up" if index < warmup else f"round {index - warmup + 1}/{rounds}"
                log(f"{counted} {label}: {values[label]['value']:.4g}")
        if index >= warmup:
            measured.append(values)
    summary = summarize(measured, baseline=baseline)
    summary.update(load_start=load_start, load_end=_load(), wall_seconds=time.time() - started, warmup=warmup)
    return summary


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds, *, baseline):
    """Per variant: the values, the ratios to the same round's baseline, median and spread.

    Args:
      rounds: a list of dicts label -> {"value": number, ...other numbers}.
      baseline: the label ratios are taken to.
    """
    labels = list(rounds[0])
    variants = {}
    for label in labels:
        values = [r[label]["value"] for r in rounds]
        ratios = [r[label]["value"] / r[baseline]["value"] for r in rounds]
        extras = {}
        for key in rounds[0][label]:
            if key != "value" and all(isinstance(r[label].get(key), (int, float)) for r in rounds):
                extras[key] = statistics.median(r[label][key] for r in rounds)
        variants[label] = {
            "values": values,
            "ratios": ratios,
            "value": _spread(values),
            "ratio": _spread(ratios),
            "extras": extras,
        }
    return {"baseline": baseline, "rounds": len(rounds), "order": labels, "variants": variants}


def beyond_control(summary, label):
    """How far `label`'s median ratio lies above the control's widest ratio (<= 0: within noise).

    For a time (lower is better) a positive figure is a cost the control's noise cannot
    explain. None without a control.
    """
    variants = summary["variants"]
    if CONTROL not in variants:
        return None
    return variants[label]["ratio"]["median"] - variants[CONTROL]["ratio"]["max"]


def format_table(summary, *, what="vs baseline", percent=True):
    """One line per variant: median ratio with its min and max, and the median value."""

    def show(x):
        return f"{100 * (x - 1):+7.1f}%" if percent else f"{x:8.3f}"

    name_width = max(len(label) for label in summary["variants"]) + 1
    head = f"{'variant':<{name_width}} {what + ' (median)':>20} {'min':>8} {'max':>8} {'value (median)':>15}"
    lines = [head]
    for label, row in summary["variants"].items():
        ratio = row["ratio"]
        lines.append(
            f"{label:<{name_width}} {show(ratio['median']):>20} {show(ratio['min']):>8} "
            f"{show(ratio['max']):>8} {row['value']['median']:>15.4g}"
        )
    load = summary.get("load_start"), summary.get("load_end")
    if load[0] is not None:
        lines.append(
            f"{summary['rounds']} paired rounds, each ratio to its own round's {summary['baseline']!r}; "
            f"load average (1/5/15 min) at start {_fmt_load(load[0])}, at end {_fmt_load(load[1])}"
        )
    return "\n".join(lines)


def _fmt_load(load):
    return "/".join(f"{x:.2f}" for x in load) if load else "n/a"
