"""`hvd.run(fn, np=N)`: Horovod's in-Python launch, on tfscale's local cluster."""

from tfscale.horovod._errors import HorovodError

__all__ = ["run"]


def run(func, args=(), kwargs=None, np=1, hosts=None, env=None, start_timeout=None):
    """Runs `func(*args, **kwargs)` in `np` local processes (ranks); returns their results by rank.

    Each process gets its own `TF_CONFIG`, as under `tfscale-launch -np N`; `func` calls
    `hvd.init()` itself and must be a module-level function of an importable file.

    Args:
        func, args, kwargs: what each rank calls.
        np: the number of ranks.
        hosts: only None (one machine; use `tfscale-launch -H` for several).
        env: extra environment variables for every rank.
        start_timeout: seconds the whole run may take (default 300).

    Raises:
        HorovodError: `hosts` given, or `np` not a positive integer.
        tfscale.launch.ClusterRunError: a rank failed (its log tail is in the message).
    """
    if hosts is not None:
        raise HorovodError(
            f"Invalid value for argument `hosts`. Received: hosts={hosts!r}. Expected None: hvd.run "
            "starts local ranks; use `tfscale-launch -H host:slots,...` for several machines."
        )
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise HorovodError(f"Invalid value for argument `np`. Received: np={np!r}. Expected an integer >= 1.")
    from tfscale.launch import run_local_cluster

    results = run_local_cluster(
        func, num_workers=np, args=tuple(args), kwargs=kwargs, env=env, timeout=start_timeout or 300.0
    )
    return [r.value for r in results]
