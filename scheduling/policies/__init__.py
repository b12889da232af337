"""KV-cache policies: an Enum of names, the :class:`KVPolicy` ABC and a factory.

``make_policy("continuum", {"ttl_rule": "fixed", "ttl_s": 5})`` -> a fresh policy object (one per
replay: policies hold state). Unknown names or parameters raise :class:`ConfigError`.
"""
from __future__ import annotations

import enum
from dataclasses import fields

from common.errors import ConfigError, suggest
from scheduling.policies.base import ExternalLoad, FCFSQueue, KVPolicy, PriorityQueue, RequestQueue
from scheduling.policies.continuum import ContinuumParams, ContinuumPolicy
from scheduling.policies.continuum_offload import ContinuumOffloadParams, ContinuumOffloadPolicy
from scheduling.policies.cpu_offload import CPUOffloadParams, CPUOffloadPolicy
from scheduling.policies.fcfs import FCFSPolicy
from scheduling.policies.jitserve import JITServeParams, JITServePolicy
from scheduling.policies.lmcache import LMCacheParams, LMCachePolicy
from scheduling.policies.ordering import LASParams, LASPolicy, SJFParams, SJFPolicy, SRTFParams, SRTFPolicy


class PolicyKind(str, enum.Enum):
    FCFS = "fcfs"
    CONTINUUM = "continuum"
    CPU_OFFLOAD = "cpu-offload"
    LMCACHE = "lmcache"
    CONTINUUM_OFFLOAD = "continuum-offload"
    SJF = "sjf"
    SRTF = "srtf"
    LAS = "las"
    JITSERVE = "jitserve"


_REGISTRY = {
    PolicyKind.FCFS: (FCFSPolicy, None),
    PolicyKind.CONTINUUM: (ContinuumPolicy, ContinuumParams),
    PolicyKind.CPU_OFFLOAD: (CPUOffloadPolicy, CPUOffloadParams),
    PolicyKind.LMCACHE: (LMCachePolicy, LMCacheParams),
    PolicyKind.CONTINUUM_OFFLOAD: (ContinuumOffloadPolicy, ContinuumOffloadParams),
    PolicyKind.SJF: (SJFPolicy, SJFParams),
    PolicyKind.SRTF: (SRTFPolicy, SRTFParams),
    PolicyKind.LAS: (LASPolicy, LASParams),
    PolicyKind.JITSERVE: (JITServePolicy, JITServeParams),
}

POLICY_NAMES = tuple(k.value for k in PolicyKind)


def policy_kind(name: str) -> PolicyKind:
    try:
        return PolicyKind(name)
    except ValueError:
        raise ConfigError(f"unknown policy '{name}'{suggest(name, POLICY_NAMES)}; known: {', '.join(POLICY_NAMES)}") from None


def param_names(name: str) -> tuple[str, ...]:
    _, params_cls = _REGISTRY[policy_kind(name)]
    return tuple(f.name for f in fields(params_cls)) if params_cls else ()


def make_policy(name: str, params: dict | None = None) -> KVPolicy:
    """A new policy object by name with parameters (only those the policy knows)."""
    cls, params_cls = _REGISTRY[policy_kind(name)]
    params = dict(params or {})
    if params_cls is None:
        if params:
            raise ConfigError(f"policy '{name}' takes no parameters (got: {', '.join(sorted(params))})")
        return cls()
    known = {f.name for f in fields(params_cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"policy '{name}' has no parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return cls(params_cls(**params))


__all__ = ["PolicyKind", "POLICY_NAMES", "KVPolicy", "RequestQueue", "FCFSQueue", "PriorityQueue", "ExternalLoad",
           "make_policy", "param_names", "policy_kind", "ContinuumParams", "CPUOffloadParams", "LMCacheParams",
           "ContinuumOffloadParams", "SJFParams", "SRTFParams", "LASParams", "JITServeParams"]
