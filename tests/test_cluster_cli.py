"""`tfscale-tfconfig` run as a real binary: TF_CONFIG printing, job files, and bad input."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tfscale.cluster import ClusterSpec

BIN_DIR = Path(sys.executable).parent
TFCONFIG = str(BIN_DIR / "tfscale-tfconfig")
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TF_CONFIG", "TFSCALE"))}


def run(*args, env=None, cwd=None, binary=(TFCONFIG,)):
    return subprocess.run(
        [*binary, *args],
        env=dict(CLEAN_ENV, **(env or {})),
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(*args, **kwargs):
    result = run(*args, **kwargs)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_prints_every_task_of_a_host_list():
    out = ok("--from=hosts", "--workers=node1:2,node2", "--chief=node0", "--port=3000")
    spec = ClusterSpec.from_hosts(workers=["node1:2", "node2"], chief="node0", port=3000)
    assert out.splitlines() == [spec.to_json(t, i) for t, i, _ in spec.tasks()]
    assert [json.loads(line)["task"] for line in out.splitlines()] == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "worker", "index": 1},
        {"type": "worker", "index": 2},
    ]


def test_module_entry_point_matches_console_script():
    args = ("--from=hosts", "--workers=a,b", "--task=worker:1")
    assert ok(*args, binary=(sys.executable, "-m", "tfscale.cluster_cli")) == ok(*args)


def test_bare_chief_and_evaluator_go_on_the_first_host_as_the_launcher_places_them():
    out = ok("--from=hosts", "--hosts=node1:2,node2", "--chief", "--evaluator", "--port=3000")
    spec = ClusterSpec.from_hosts(workers=["node1:2", "node2"], chief="node1", evaluator="node1", port=3000)
    assert [json.loads(line) for line in out.splitlines()] == [
        spec.to_tf_config(t, i) for t, i, _ in spec.tasks()
    ]


def test_importing_the_cli_does_not_import_tensorflow():
    code = "import sys, tfscale.cluster, tfscale.cluster_cli; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, env=CLEAN_ENV).returncode == 0


def test_export_format_evaluates_in_bash(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two GPUs each\nnode1 slots=2\nnode2 slots=2\n")
    line = ok("--from=hostfile", f"--hostfile={hostfile}", "--task=worker:3", "--format=export")
    assert line.startswith("export TF_CONFIG='")
    shown = subprocess.run(
        ["bash", "-c", line + '\nprintf %s "$TF_CONFIG"'], check=False, capture_output=True, text=True
    )
    assert json.loads(shown.stdout) == {
        "cluster": {"worker": ["node1:2222", "node1:2223", "node2:2222", "node2:2223"]},
        "task": {"type": "worker", "index": 3},
    }


def test_sources_with_a_task_print_only_that_task():
    slurm = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "1"}
    assert json.loads(ok("--from=slurm", "--port=4000", env=slurm)) == {
        "cluster": {"worker": ["n1:4000", "n2:4000"]},
        "task": {"type": "worker", "index": 1},
    }
    config = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "chief", "index": 0}}
    assert json.loads(ok("--from=env", env={"TF_CONFIG": json.dumps(config)})) == config
    assert len(ok("--from=env", "--task=all", env={"TF_CONFIG": json.dumps(config)}).splitlines()) == 2
    k8s = {"HOSTNAME": "train-1", "TFSCALE_REPLICAS": "2", "TFSCALE_SERVICE": "train"}
    assert json.loads(ok("--from=kubernetes", env=k8s))["cluster"]["worker"][1] == (
        "train-1.train.default.svc.cluster.local:2222"
    )


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        ((), {}, "Missing `--from`"),
        (("--from=cloud",), {}, "--from"),
        (("--from=hosts",), {}, "Missing `--workers` (alias of `--hosts`)"),
        (("--from=hosts", "--workers=a", "--chief=a,b"), {}, "--chief=a,b: expected one host"),
        (("--from=hosts", "--workers=a:0"), {}, "`workers[0]`"),
        (("--from=hosts", "--workers=a:3000,a:3000"), {}, "Duplicate address"),
        (("--from=hosts", "--workers=a", "--task=worker:1"), {}, "`--task`. Received: 'worker:1'"),
        (("--from=hosts", "--workers=a", "--task=boss"), {}, "`--task`. Received: 'boss'"),
        (("--from=hosts", "--workers=a", "--port=70000"), {}, "--port"),
        (("--from=hosts", "--workers=a", "--hostfile=h"), {}, "`--hostfile` is not used with --from=hosts"),
        (("--from=hostfile", "--hostfile=/nonexistent"), {}, "Cannot read hostfile"),
        (("--from=slurm",), {"SLURM_PROCID": "0"}, "`SLURM_JOB_NODELIST` is not set"),
        (("--from=env",), {"TF_CONFIG": '{"cluster": {"worker": ["a:1", 2]}}'}, "`cluster.worker[1]`"),
        (("--from=env",), {"TF_CONFIG": "{"}, "not JSON"),
        (("--from=hosts", "--workers=a", "extra"), {}, "Unexpected argument 'extra'"),
        (("--no-such-flag",), {}, "no-such-flag"),
        (("--tfjob=j.yaml", "--command=x"), {}, "Missing `--image`"),
        (("--tfjob=j.yaml", "--image=i", "--command=x", "--replicas=chief=2"), {}, "`--replicas`"),
        (("--tfjob=j.yaml", "--image=i", "--command=x", "--job_name=Bad_Name"), {}, "`job_name`"),
        (("--sbatch=j.sh", "--command=python 'unterminated"), {}, "`--command`"),
        (("--sbatch=j.sh",), {}, "Missing `--command`"),
        (("--sbatch=j.sh", "--command=x", "--image=i"), {}, "`--image` is not used without --tfjob"),
        (("--sbatch=j.sh", "--command=x", "--from=slurm"), {}, "`--from` is not used when writing job files"),
        (("--sbatch=no/such/dir/j.sh", "--command=x"), {}, "Cannot write `--sbatch`='no/such/dir/j.sh'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, env, match):
    result = run(*args, env=env, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("tfscale-tfconfig: error: ")
    assert match in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_failed_job_file_leaves_existing_file_untouched(tmp_path):
    (tmp_path / "job.yaml").write_text("old\n")
    result = run("--tfjob=job.yaml", "--image=img", "--command=x", "--replicas=worker=0", cwd=tmp_path)
    assert result.returncode == 2
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]
    assert (tmp_path / "job.yaml").read_text() == "old\n"


def test_tfjob_manifest_has_kubeflow_fields(tmp_path):
    command = "python train.py --epochs=3 --name 'my run'"
    out = ok(
        "--tfjob=job.yaml",
        "--image=registry.example.com/me/train:1.0",
        f"--command={command}",
        "--replicas=worker=3,chief=1,ps=2,evaluator=1",
        "--namespace=ml",
        "--job_name=mnist",
        "--port=2345",
        cwd=tmp_path,
    )
    assert out == "wrote job.yaml\n"
    manifest = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "mnist", "namespace": "ml"}
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {name: s["replicas"] for name, s in specs.items()} == {
        "Chief": 1,
        "Worker": 3,
        "PS": 2,
        "Evaluator": 1,
    }
    for replica in specs.values():
        assert replica["restartPolicy"] == "OnFailure"
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["image"] == "registry.example.com/me/train:1.0"
        assert container["command"] == shlex.split(command)
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2345}]


FAKE_SRUN = r"""#!/bin/bash
# Fake srun for tests: runs the step once per task, one after another, with the
# variables a real srun step sets. FAKE_NODES / FAKE_TASKS_PER_NODE give the layout.
while [[ "$1" == --* ]]; do shift; done
read -r -a nodes <<< "$FAKE_NODES"
read -r -a counts <<< "$FAKE_TASKS_PER_NODE"
rank=0
for n in "${!nodes[@]}"; do
  for ((local = 0; local < counts[n]; local++)); do
    SLURM_STEP_NODELIST="$SLURM_JOB_NODELIST" SLURM_STEP_TASKS_PER_NODE="$SLURM_TASKS_PER_NODE" \
    SLURM_STEP_NUM_TASKS="$SLURM_NTASKS" SLURM_PROCID=$rank SLURM_LOCALID=$local \
    SLURMD_NODENAME="${nodes[n]}" "$@" || exit $?
    rank=$((rank + 1))
  done
done
"""


@pytest.fixture
def sbatch_job(tmp_path):
    """An sbatch script from the CLI whose tasks save their TF_CONFIG, plus a fake srun on PATH."""
    command = "bash -c 'printenv TF_CONFIG > \"$OUT_DIR/$SLURM_PROCID.json\"'"
    ok(
        "--sbatch=job.sbatch",
        "--nodes=3",
        "--ntasks_per_node=2",
        f"--command={command}",
        "--port=5000",
        cwd=tmp_path,
    )
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text(FAKE_SRUN)
    (fake_bin / "srun").chmod(0o755)
    (tmp_path / "out").mkdir()
    env = dict(
        CLEAN_ENV,
        PATH=f"{fake_bin}:{BIN_DIR}:/usr/bin:/bin",
        OUT_DIR=str(tmp_path / "out"),
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="gpu-a[01-02],gpu-b07",
        SLURM_TASKS_PER_NODE="2(x3)",
        SLURM_NTASKS="6",
        FAKE_NODES="gpu-a01 gpu-a02 gpu-b07",
        FAKE_TASKS_PER_NODE="2 2 2",
    )
    return tmp_path / "job.sbatch", env, tmp_path / "out"


def test_sbatch_script_passes_bash_n(sbatch_job):
    script, _, _ = sbatch_job
    assert subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert os.access(script, os.X_OK)


def test_sbatch_script_gives_each_slurm_task_its_tf_config(sbatch_job):
    script, env, out = sbatch_job
    result = subprocess.run(
        ["bash", str(script)], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    # Expected layout written out by hand: block distribution, ports from 5000 on each node.
    expected = [
        "gpu-a01:5000",
        "gpu-a01:5001",
        "gpu-a02:5000",
        "gpu-a02:5001",
        "gpu-b07:5000",
        "gpu-b07:5001",
    ]
    for rank in range(6):
        config = json.loads((out / f"{rank}.json").read_text())
        assert config == {"cluster": {"worker": expected}, "task": {"type": "worker", "index": rank}}


def test_sbatch_task_stops_before_the_command_when_slurm_variables_are_wrong(sbatch_job):
    script, env, out = sbatch_job
    env["SLURM_NTASKS"] = "5"  # disagrees with SLURM_TASKS_PER_NODE
    result = subprocess.run(
        ["bash", str(script)], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Inconsistent Slurm variables" in result.stderr
    assert list(out.iterdir()) == []
