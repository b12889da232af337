"""The cluster's settings as users write them: ``gpubench replay``'s options (how many replicas, which
router, how stale its view) and a sweep label's ``replicas=4+router=prefix+router.beta=2``."""
from __future__ import annotations

import argparse
import json
from typing import Any

from common.errors import ConfigError
from scheduling.cluster.pd import LINK_KINDS, PREFIX_CACHING, RESERVE_MODES
from scheduling.cluster.routers import ROUTER_NAMES


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster options (several replicas behind a router; docs/cluster.md)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engines, each with its own KV pool and policy, behind one router")
    g.add_argument("--router", default="round-robin", choices=ROUTER_NAMES,
                   help="which replica serves a turn: round-robin, least-loaded (vLLM's data-parallel score), "
                        "session (consistent hash of the job), prefix (longest prefix sent there), load-aware "
                        "(prefix share minus load), cache-aware (SGLang), scorers (llm-d), kv-cost (Dynamo); recorded "
                        "(--router-param turns=TURNS.CSV: the routes a replay took, a diagnostic)")
    g.add_argument("--router-param", action="append", default=[], metavar="KEY=VALUE", dest="router_param",
                   help="a router parameter (e.g. beta=2 for load-aware, temperature=0.5 for kv-cost); repeatable")
    g.add_argument("--stats-interval-s", type=float, default=0.0,
                   help="the router sees the replicas' load as scraped this often (0: fresh at every turn)")
    g.add_argument("--prefix-ttl-s", type=float, default=120.0,
                   help="how long the router trusts its record of a prefix it sent to a replica")
    g.add_argument("--max-outstanding", type=int, default=None,
                   help="refuse a turn when the replica picked has this many in flight (counted against goodput)")
    g = p.add_argument_group("prefill/decode disaggregation (docs/cluster.md)")
    g.add_argument("--prefill-replicas", type=int, default=0,
                   help="prefill instances in front of the --replicas, which then only decode (0: aggregated)")
    g.add_argument("--kv-link", default="auto", choices=LINK_KINDS,
                   help="the link a turn's KV takes to its decode instance, at the SKU table's bandwidth "
                        "(auto: NVLink where the GPU has it, else its network, else PCIe)")
    g.add_argument("--kv-link-gbs", type=float, default=None, help="the link's bandwidth per direction in GB/s instead")
    g.add_argument("--kv-link-latency-s", type=float, default=None,
                   help="seconds every hand-off costs besides its bytes, instead of the link's (5-10 us); "
                        "`gpubench vllm kv-file-rate` measures both for vLLM's file connector on this host")
    g.add_argument("--kv-file-rate", default=None, metavar="PATH",
                   help="with --kv-link file (vLLM's ExampleConnector, what a live pair on this CPU runs): the "
                        "kv_file_rate.json `gpubench vllm kv-file-rate --out DIR` measured")
    g.add_argument("--kv-layerwise", action="store_true", help="send the KV layer by layer during the prefill (overlapped)")
    g.add_argument("--kv-reserve", default="before", choices=RESERVE_MODES,
                   help="before: the decode instance reserves blocks, then pulls what it misses (vLLM's NixlConnector); "
                        "after: the prefill instance pushes the whole prompt's KV to a staging buffer")
    g.add_argument("--pd-threshold-tokens", type=int, default=0,
                   help="prefill a turn on its decode instance when it is likely to miss fewer tokens than this")
    g.add_argument("--pd-prefix-caching", default="both", choices=PREFIX_CACHING,
                   help="which side looks prefixes up (SGLang's default, no radix cache on the decode side, "
                        "is 'prefill')")


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
                  max_outstanding=args.max_outstanding, prefill_replicas=args.prefill_replicas, kv_link=args.kv_link,
                  kv_link_gbs=args.kv_link_gbs, kv_link_latency_s=args.kv_link_latency_s, kv_file_rate=args.kv_file_rate,
                  kv_layerwise=args.kv_layerwise, kv_reserve=args.kv_reserve,
                  pd_threshold_tokens=args.pd_threshold_tokens, pd_prefix_caching=args.pd_prefix_caching)
    if args.replicas == 1 and not args.prefill_replicas and (params or args.router != "round-robin"
                                                             or args.max_outstanding is not None):
        raise ConfigError("--router, --router-param and --max-outstanding route between replicas: add --replicas N "
                          "(N >= 2) or --prefill-replicas P")
    pd_given = (args.kv_link != "auto" or args.kv_link_gbs is not None or args.kv_link_latency_s is not None
                or args.kv_file_rate is not None
                or args.kv_layerwise or args.kv_reserve != "before"
                or args.pd_threshold_tokens or args.pd_prefix_caching != "both")
    if pd_given and not args.prefill_replicas:
        raise ConfigError("the --kv-* and --pd-* options shape prefill/decode disaggregation: add --prefill-replicas P")
    return fields


CLUSTER_KEYS = ("replicas", "router", "stats_interval_s", "prefix_ttl_s", "max_outstanding", "prefill_replicas", "kv_link",
                "kv_link_gbs", "kv_link_latency_s", "kv_file_rate", "kv_layerwise", "kv_reserve", "pd_threshold_tokens",
                "pd_prefix_caching")


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
