"""Property tests: the TF_CONFIG round trip over generated clusters, and fuzzed bad input.

Fuzzed TF_CONFIGs, hostfiles and Slurm variables must each end in a parsed spec or a
`ClusterSpecError`: nothing else raised, and nothing slow (an alarm stops any input
that takes more than a few seconds, which would count as a hang).
"""

import contextlib
import json
import os
import signal

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tfscale.cluster import TASK_TYPES, ClusterSpec, ClusterSpecError

# Under CI=true every run draws the same examples (seeded from each test's name), so a red
# build is reproducible and never depends on luck; elsewhere each run explores new inputs.
# Said here, not left to Hypothesis's own CI detection (only in recent versions).
settings.register_profile("tfscale-ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("tfscale-ci")

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HANG_SECONDS = 5


class _Hang(Exception):
    pass


@contextlib.contextmanager
def no_hang():
    def alarm(signum, frame):
        raise _Hang(f"input took more than {HANG_SECONDS}s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def parse_or_clean_error(parse, value):
    """Runs `parse(value)`; returns the spec or None after a one-line `ClusterSpecError`."""
    with no_hang():
        try:
            spec = parse(value)
        except ClusterSpecError as e:
            assert str(e) and "\n" not in str(e)
            event("ClusterSpecError: " + str(e).split(".")[0][:40])
            return None
    event("parsed")
    # Whatever parsed must survive its own round trip.
    for task_type, index, _ in spec.tasks()[:3]:
        assert ClusterSpec.from_tf_config(spec.to_json(task_type, index)) == spec.with_task(task_type, index)
    return spec


# --- round trip ---------------------------------------------------------------------------------

hosts = st.one_of(
    st.builds(
        "{}{}{}".format,
        st.sampled_from("abcnwx"),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", max_size=8),
        st.sampled_from(["", ".local", ".cluster.example.org", ".svc"]),
    ),
    st.builds("{}.{}.{}.{}".format, *[st.integers(0, 255)] * 4),
    st.sampled_from(["[::1]", "[fe80::1]", "localhost"]),
)


@st.composite
def clusters(draw):
    """A valid cluster of any shape: optional chief/evaluator, 0-6 workers, 0-3 ps, distinct addresses."""
    counts = {
        "chief": draw(st.integers(0, 1)),
        "worker": draw(st.integers(0, 6)),
        "ps": draw(st.integers(0, 3)),
        "evaluator": draw(st.integers(0, 1)),
    }
    if not any(counts.values()):
        counts["worker"] = 1
    total = sum(counts.values())
    addresses = draw(
        st.lists(
            st.builds("{}:{}".format, hosts, st.integers(1, 65535)),
            min_size=total,
            max_size=total,
            unique_by=lambda a: a.lower(),
        )
    )
    order = draw(st.permutations([t for t in TASK_TYPES if counts[t]]))  # input order must not matter
    cluster, start = {}, 0
    for task_type in TASK_TYPES:
        cluster[task_type], start = addresses[start : start + counts[task_type]], start + counts[task_type]
    return {t: cluster[t] for t in order}


@settings(max_examples=500, deadline=None)
@given(clusters(), st.data())
@pytest.mark.slow  # 28 s (500 examples); fast tier: test_cluster's cases
def test_round_trip_every_task_agrees_on_the_cluster(cluster, data):
    spec = ClusterSpec(cluster)
    assert spec.task_count == sum(len(a) for a in cluster.values())
    assert spec.num_workers == len(cluster.get("chief", [])) + len(cluster.get("worker", []))
    configs = [spec.to_tf_config(t, i) for t, i, _ in spec.tasks()]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    assert configs[0]["cluster"] == {t: cluster[t] for t in TASK_TYPES if cluster.get(t)}
    task_type, index, _ = data.draw(st.sampled_from(spec.tasks()))
    for text in (spec.to_json(task_type, index), json.dumps(spec.to_tf_config(task_type, index))):
        parsed = ClusterSpec.from_tf_config(text)
        assert parsed == spec.with_task(task_type, index)
        assert ClusterSpec.from_tf_config(parsed.to_tf_config()) == parsed
    assert ClusterSpec.from_env({"TF_CONFIG": spec.to_json()}) == spec


# --- fuzzing ------------------------------------------------------------------------------------

plausible = st.sampled_from(
    ["worker", "chief", "ps", "evaluator", "a:1", "b:2222", "a:0", "x", 0, 1, 2, -1, 1.0]
)
json_values = st.recursive(
    plausible | st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(
    ["cluster", "task", "type", "index", "worker", "chief", "ps", "evaluator", "environment"]
)


@st.composite
def mutated_tf_configs(draw):
    """A valid TF_CONFIG with one value replaced, one key dropped, or its text cut/garbled."""
    config = ClusterSpec(draw(clusters())).to_tf_config()
    config["task"] = {"type": next(iter(config["cluster"])), "index": 0}
    how = draw(st.sampled_from(["none", "replace", "drop", "add", "cut", "garble"]))
    if how == "none":
        return json.dumps(config)
    if how in ("replace", "drop", "add"):
        parent = draw(st.sampled_from([config, config["cluster"], config["task"]]))
        key = draw(st.sampled_from(sorted(parent)))
        if how == "drop":
            del parent[key]
        elif how == "add":
            parent[draw(keys)] = draw(json_values)
        elif isinstance(parent[key], list) and parent[key] and draw(st.booleans()):
            parent[key][draw(st.integers(0, len(parent[key]) - 1))] = draw(json_values)
        else:
            parent[key] = draw(json_values)
        return json.dumps(config)
    text = json.dumps(config)
    cut = draw(st.integers(0, len(text)))
    if how == "cut":
        return text[:cut]
    return text[:cut] + draw(st.text(max_size=5)) + text[cut + draw(st.integers(0, 5)) :]


@FUZZ
@given(
    st.one_of(
        mutated_tf_configs(),
        st.text(max_size=60),
        json_values.map(json.dumps),
        st.binary(max_size=40),
        st.integers(1, 3000).map(lambda n: "[" * n),
    )
)
def test_fuzzed_tf_config_parses_or_raises_cluster_spec_error(text):
    parse_or_clean_error(ClusterSpec.from_tf_config, text)


ports = st.one_of(st.just(2222), st.just(65530), st.integers(-1, 70000))
host_lines = st.builds(
    "{} slots={}{}".format,
    hosts,
    st.integers(1, 5),
    st.sampled_from(["", " max_slots=8", "  # comment", " max-slots=2"]),
)
hostfile_tokens = st.one_of(
    hosts,
    st.sampled_from(
        ["slots=", "max_slots=", "#", "slots=1", "slots=4", "slots=-1", "slots=0", "gpus=2", "\t"]
    ),
    st.builds("slots={}".format, st.integers(-5, 10**9)),
    st.text(max_size=6),
)
hostfiles = st.lists(
    st.one_of(host_lines, host_lines, st.lists(hostfile_tokens, max_size=4).map(" ".join)), max_size=8
).map("\n".join)


@pytest.fixture(scope="module")
def hostfile_path(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "hostfile"


@FUZZ
@given(st.one_of(hostfiles, hostfiles, st.binary(max_size=30)), ports)
def test_fuzzed_hostfile_parses_or_raises_cluster_spec_error(hostfile_path, content, port):
    if isinstance(content, bytes):
        hostfile_path.write_bytes(content)
    else:
        hostfile_path.write_text(content, encoding="utf-8", errors="surrogatepass")
    parse_or_clean_error(lambda path: ClusterSpec.from_hostfile(path, port=port), hostfile_path)


nodelists = st.one_of(
    st.text(alphabet="nod0123456789[]-,xa", max_size=24),
    st.builds(
        "{}[{}]".format,
        st.sampled_from(["node", "gpu-a", "", "n."]),
        st.lists(
            st.one_of(
                st.from_regex(r"[0-9]{1,4}", fullmatch=True),
                st.from_regex(r"[0-9]{1,4}-[0-9]{1,6}", fullmatch=True),
            ),
            min_size=1,
            max_size=3,
        ).map(",".join),
    ),
)
tasks_per_node = st.one_of(
    st.text(alphabet="0123456789(x),", max_size=16),
    st.lists(
        st.builds("{}(x{})".format, st.integers(0, 4), st.integers(0, 10**7)) | st.integers(0, 5).map(str),
        min_size=1,
        max_size=3,
    ).map(",".join),
)
numbers = st.one_of(st.integers(-2, 12).map(str), st.text(max_size=4), st.just(""))


def _known_slurm_answer(nodes, counts, distribution, procid, port):
    """The workers and this task's index Slurm's layout gives, or None where `port` cannot hold it.

    Written from Slurm's documentation, not from tfscale: "block" fills each node with
    consecutive ranks, nodes in node-list order; "cyclic" deals ranks one per node in turn,
    skipping full nodes. A node's tasks listen on consecutive ports from `port`.
    """
    if not 1 <= port or port + max(counts) - 1 > 65535:
        return None
    if distribution == "cyclic":
        slots = [(n, i) for i in range(max(counts)) for n in range(len(nodes)) if i < counts[n]]
    else:
        slots = [(n, i) for n in range(len(nodes)) for i in range(counts[n])]
    return ClusterSpec({"worker": [f"{nodes[n]}:{port + i}" for n, i in slots]}, "worker", procid)


@st.composite
def consistent_slurm_envs(draw):
    """A consistent Slurm step or job environment, and the facts that determine its answer."""
    groups = draw(
        st.lists(st.tuples(st.sampled_from(["node", "gpu-a", "n"]), st.integers(0, 120)), min_size=1)
    )
    nodes = sorted({f"{prefix}{number:03d}" for prefix, number in groups})
    counts = draw(st.lists(st.integers(1, 3), min_size=len(nodes), max_size=len(nodes)))
    step = draw(st.booleans())
    names = (
        ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")
        if step
        else ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS")
    )
    procid = draw(st.integers(0, sum(counts) - 1))
    env = {
        names[0]: ",".join(f"{n[:-3]}[{n[-3:]}]" if draw(st.booleans()) else n for n in nodes),
        names[1]: ",".join(f"{c}(x1)" if draw(st.booleans()) else str(c) for c in counts),
        names[2]: str(sum(counts)),
        "SLURM_PROCID": str(procid),
    }
    distribution = draw(st.sampled_from([None, "block", "cyclic", "cyclic:block", "block:cyclic"]))
    if distribution is not None:
        env["SLURM_DISTRIBUTION"] = distribution
    node_level = (distribution or "block").split(":")[0]
    return env, (nodes, counts, node_level, procid)


@st.composite
def slurm_envs(draw):
    """A consistent Slurm environment, then one variable garbled or dropped (or none)."""
    env, _ = draw(consistent_slurm_envs())
    victim = draw(st.sampled_from([None, *env]))
    if victim is not None:
        mutation = draw(st.sampled_from(["drop", "nodelist", "tasks", "number"]))
        if mutation == "drop":
            del env[victim]
        else:
            env[victim] = draw({"nodelist": nodelists, "tasks": tasks_per_node, "number": numbers}[mutation])
    return env


@FUZZ
@given(consistent_slurm_envs(), ports)
def test_consistent_slurm_variables_give_the_known_cluster(environ_and_facts, port):
    environ, facts = environ_and_facts
    want = _known_slurm_answer(*facts, port)
    with no_hang():
        if want is None:
            with pytest.raises(ClusterSpecError, match=r"`port`"):
                ClusterSpec.from_slurm(environ, port=port)
            return
        assert ClusterSpec.from_slurm(environ, port=port) == want


@FUZZ
@given(slurm_envs(), ports)
def test_fuzzed_consistent_then_garbled_slurm_variables(environ, port):
    spec = parse_or_clean_error(lambda env: ClusterSpec.from_slurm(env, port=port), environ)
    if spec is not None:
        assert spec.task_count == sum(1 for _ in spec.tasks())


@FUZZ
@given(
    st.fixed_dictionaries(
        {"SLURM_PROCID": numbers},
        optional={
            "SLURM_STEP_NODELIST": nodelists,
            "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "SLURM_STEP_NUM_TASKS": numbers,
            "SLURM_JOB_NODELIST": nodelists,
            "SLURM_TASKS_PER_NODE": tasks_per_node,
            "SLURM_NTASKS": numbers,
            "SLURMD_NODENAME": st.sampled_from(["node1", "n", ""]),
            "SLURM_LOCALID": numbers,
            "SLURM_DISTRIBUTION": st.sampled_from(
                ["block", "cyclic", "cyclic:block", "plane=2", "arbitrary", ""]
            ),
        },
    ),
    ports,
)
def test_fuzzed_slurm_variables_parse_or_raise_cluster_spec_error(environ, port):
    spec = parse_or_clean_error(lambda env: ClusterSpec.from_slurm(env, port=port), environ)
    if spec is not None:
        assert spec.task_type == "worker" and spec.task_index == int(environ["SLURM_PROCID"])
