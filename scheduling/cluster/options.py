"""The cluster's settings as users write them: ``gpubench replay``'s options (how many replicas, which
router, how stale its view) and a sweep label's ``replicas=4+router=prefix+router.beta=2``."""
from __future__ import annotations

import argparse
import json
from typing import Any

from common.errors import ConfigError
from scheduling.cluster.routers import ROUTER_NAMES


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster options (several replicas behind a router; docs/cluster.md)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engines, each with its own KV pool and policy, behind one router")
    g.add_argument("--router", default="round-robin", choices=ROUTER_NAMES,
                   help="which replica serves a turn: round-robin, least-loaded (vLLM's data-parallel score), "
                        "session (consistent hash of the job), prefix (longest prefix sent there), load-aware "
                        "(prefix share minus load), cache-aware (SGLang), scorers (llm-d), kv-cost (Dynamo)")
    g.add_argument("--router-param", action="append", default=[], metavar="KEY=VALUE", dest="router_param",
                   help="a router parameter (e.g. beta=2 for load-aware, temperature=0.5 for kv-cost); repeatable")
    g.add_argument("--stats-interval-s", type=float, default=0.0,
                   help="the router sees the replicas' load as scraped this often (0: fresh at every turn)")
    g.add_argument("--prefix-ttl-s", type=float, default=120.0,
                   help="how long the router trusts its record of a prefix it sent to a replica")
    g.add_argument("--max-outstanding", type=int, default=None,
                   help="refuse a turn when the replica picked has this many in flight (counted against goodput)")


def cluster_fields(args: argparse.Namespace) -> dict:
    """The ReplayConfig fields of the cluster options (a router option without --replicas > 1 is refused)."""
    params = {}
    for item in getattr(args, "router_param", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--router-param {item!r}: expected KEY=VALUE")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    fields = dict(replicas=args.replicas, router=args.router, router_params=params,
                  stats_interval_s=args.stats_interval_s, prefix_ttl_s=args.prefix_ttl_s,
                  max_outstanding=args.max_outstanding)
    if args.replicas == 1 and (params or args.router != "round-robin" or args.max_outstanding is not None):
        raise ConfigError("--router, --router-param and --max-outstanding route between replicas: add --replicas N (N >= 2)")
    return fields


CLUSTER_KEYS = ("replicas", "router", "stats_interval_s", "prefix_ttl_s", "max_outstanding")


def cluster_variant(variant: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A label's parameters split: ``(policy parameters, ReplayConfig cluster fields)``."""
    policy, cluster, router = {}, {}, {}
    for k, v in variant.items():
        if k in CLUSTER_KEYS:
            cluster[k] = v
        elif k.startswith("router."):
            router[k.split(".", 1)[1]] = v
        else:
            policy[k] = v
    if router:
        cluster["router_params"] = router
    return policy, cluster
