"""One Slurm task of `tfscale-launch --slurm`: derive TF_CONFIG from Slurm's variables, then exec the command.

Run by `srun` on every node: `python -m tfscale.launch._slurm_task --port P -- COMMAND [ARGS...]`.
"""

import os
import sys

__all__ = ["main"]


def _parse(argv):
    if len(argv) < 4 or argv[0] != "--port" or argv[2] != "--" or not argv[1].isdigit():
        raise SystemExit(f"usage: {__name__} --port P -- COMMAND [ARGS...]; received {argv!r}")
    return int(argv[1]), argv[3:]


def main(argv):
    """Execs the command of `argv` with this Slurm task's TF_CONFIG."""
    from tfscale.cluster import ClusterSpec, ClusterSpecError

    port, command = _parse(argv)
    try:
        spec = ClusterSpec.from_slurm(os.environ, port=port)
    except ClusterSpecError as e:
        raise SystemExit(f"tfscale-launch --slurm: {e}") from None
    env = dict(os.environ, TF_CONFIG=spec.to_json(spec.task_type, spec.task_index))
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])
