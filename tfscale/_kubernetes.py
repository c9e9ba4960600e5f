"""A StatefulSet pod's place in its cluster, from its host name and a headless service.

A StatefulSet names its pods `<set>-0`, `<set>-1`, ...; with a headless service
`<service>` each pod is reachable at `<set>-<i>.<service>.<namespace>.svc.<domain>`.
The pod knows its own name (`HOSTNAME`); the replica count and the service name
are not injected by Kubernetes, so the pod spec passes them as `TFSCALE_REPLICAS`
and `TFSCALE_SERVICE` (or the caller passes them as arguments), and the namespace
comes from the downward API as `POD_NAMESPACE`.
"""

import re

from tfscale._cluster_errors import ClusterSpecError, describe
from tfscale._hosts import MAX_TASKS

__all__ = ["cluster_from_statefulset"]

_POD_RE = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?)-([0-9]{1,5})")
_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def _setting(value, environ, var, name, default=None):
    if value is None:
        value = environ.get(var, "").strip() or default
    if value is None:
        raise ClusterSpecError(
            f"Missing `{name}`: pass it or set `{var}` in the pod spec. Expected it for a StatefulSet "
            "without an injected TF_CONFIG."
        )
    return value


def _label(value, name):
    if not isinstance(value, str) or not _LABEL_RE.fullmatch(value):
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected a DNS label (lowercase "
            "letters, digits and '-', at most 63 characters)."
        )
    return value


def _replicas(value):
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 6:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TASKS:
        raise ClusterSpecError(
            f"Invalid value for `replicas`. Received: {describe(value)}. Expected an "
            f"integer in 1-{MAX_TASKS}."
        )
    return value


def cluster_from_statefulset(environ, *, port, replicas=None, service=None, namespace=None, domain):
    """Returns (`{"worker": [DNS addresses]}`, this pod's ordinal)."""
    pod = environ.get("HOSTNAME", "").strip()
    match = _POD_RE.fullmatch(pod)
    if match is None:
        raise ClusterSpecError(
            f"Invalid pod name `HOSTNAME`. Received: {describe(pod)}. Expected a StatefulSet pod name "
            "'<set>-<ordinal>' (or a TF_CONFIG injected by the TFJob operator)."
        )
    statefulset, ordinal = match.group(1), int(match.group(3))
    replicas = _replicas(_setting(replicas, environ, "TFSCALE_REPLICAS", "replicas"))
    service = _label(_setting(service, environ, "TFSCALE_SERVICE", "service"), "service")
    namespace = _label(_setting(namespace, environ, "POD_NAMESPACE", "namespace", "default"), "namespace")
    if not isinstance(domain, str) or not _DOMAIN_RE.fullmatch(domain):
        raise ClusterSpecError(
            f"Invalid value for `cluster_domain`. Received: {describe(domain)}. Expected a DNS domain."
        )
    if ordinal >= replicas:
        raise ClusterSpecError(
            f"Pod {pod!r} has ordinal {ordinal} but `replicas`={replicas}. Expected an ordinal in "
            f"0-{replicas - 1}."
        )
    suffix = f"{service}.{namespace}.svc.{domain}:{port}"
    return {"worker": [f"{statefulset}-{i}.{suffix}" for i in range(replicas)]}, ordinal
