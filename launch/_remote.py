"""The per-host start command of a multi-host job: `--remote_cmd` templates.

A template is split like a shell line and may use three placeholders:

* `{host}`: the task's host as written in the cluster spec (IPv6 brackets removed);
* `{host_index}`: the position of that host among the job's distinct hosts (0, 1, ...);
* `{command}`: the task's command as *one* shell string,
  `cd <cwd> && exec env TF_CONFIG=... COMMAND ARGS`, for starters that run a
  remote shell (ssh). Without `{command}` the task is appended as argv words,
  `env TF_CONFIG=... COMMAND ARGS`, for starters that exec their arguments
  (`ip netns exec NAME`, `docker exec CONTAINER`); the working directory is then
  whatever the starter gives.

The default is `ssh -o BatchMode=yes -tt {host} {command}`: `-tt` gives the
remote task a terminal, so when the launcher stops the local ssh process the
remote side gets SIGHUP and the task does not outlive the job.
"""

import re
import shlex

from tfscale._hosts import host_of
from tfscale.launch.supervisor import LaunchError

__all__ = ["DEFAULT_REMOTE_CMD", "check_template", "host_of", "render"]

DEFAULT_REMOTE_CMD = "ssh -o BatchMode=yes -tt {host} {command}"
_PLACEHOLDERS = ("host", "host_index", "command")
_PLACEHOLDER_RE = re.compile(r"\{([^{}]*)\}")


def check_template(template):
    """Returns the words of `template`, or raises `LaunchError` naming `--remote_cmd`."""
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise LaunchError(f"Invalid value for `--remote_cmd`. Received: {template!r}. {e}.") from None
    if not words:
        raise LaunchError(f"Invalid value for `--remote_cmd`. Received: {template!r}. Expected a command.")
    for word in words:
        for name in _PLACEHOLDER_RE.findall(word):
            if name not in _PLACEHOLDERS:
                raise LaunchError(
                    f"Invalid placeholder in `--remote_cmd`. Received: {{{name}}} in {template!r}. "
                    "Expected only {host}, {host_index} and {command}."
                )
    if sum("{command}" in word for word in words) > 1 or any(
        "{command}" in w and w != "{command}" for w in words
    ):
        raise LaunchError(
            f"Invalid value for `--remote_cmd`. Received: {template!r}. Expected {{command}} at most once, "
            "as a word of its own."
        )
    return words


def render(template, *, host, host_index, env, command, cwd):
    """The local argv that starts `command` on `host` with the variables `env` set.

    Args:
        template: a `--remote_cmd` template (see the module docstring).
        host: the task's host.
        host_index: the host's position among the job's hosts.
        env: variables for the task (TF_CONFIG, ...), passed as `env` assignments.
        command: the user's command, a list of words.
        cwd: the directory the remote shell changes to (with `{command}`).
    """
    words = check_template(template)
    plain_host = host.strip("[]")
    assignments = [f"{key}={value}" for key, value in env.items()]
    argv = []
    for word in words:
        if word == "{command}":
            argv.append(_shell_command(assignments, command, cwd))
        else:
            argv.append(word.replace("{host_index}", str(host_index)).replace("{host}", plain_host))
    if "{command}" not in words:
        argv += ["env", *assignments, *command]
    return argv


def _shell_command(assignments, command, cwd):
    words = ["exec", "env", *assignments, *command]
    return f"cd {shlex.quote(cwd)} && " + " ".join(shlex.quote(w) for w in words)
