"""Routers: which replica serves a turn, each a small class behind one interface, after what the
public routers do (docs/cluster.md gives each one's source and what is ours).

``route(turn, view, now_s)`` returns a replica index from what :class:`~scheduling.cluster.view.ClusterView`
holds: the router's own traffic (exact), the replicas' scraped load (possibly stale) and its own
record of the prefixes it sent where (approximate). Ties go to the lowest index unless the router
it follows breaks them at random (llm-d, Dynamo): then to a draw from the router's own seeded
generator, so a replay stays deterministic.
"""
from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass, fields

from common.errors import ConfigError
from scheduling.cluster.view import ClusterView, TurnToRoute
from scheduling.policies.base import check_params


class Router:
    """Picks a replica for each turn. ``Params``: the router's parameters (a frozen dataclass)."""

    name = ""
    Params: type | None = None
    scrapes_loads = False  # reads the replicas' scraped load (the cluster scrapes only for these)

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        self.num_replicas = num_replicas
        self.p = params
        self.rng = random.Random(seed)

    def route(self, turn: TurnToRoute, view: ClusterView, now_s: float) -> int:
        raise NotImplementedError

    def params(self) -> dict:
        return {f.name: getattr(self.p, f.name) for f in fields(self.p)} if self.p is not None else {}

    def _argmin(self, values: list, *, random_ties: bool = False) -> int:
        best = min(values)
        ties = [i for i, v in enumerate(values) if v == best]
        return ties[self.rng.randrange(len(ties))] if random_ties and len(ties) > 1 else ties[0]


class RoundRobin(Router):
    """Each turn to the next replica in turn (production-stack's default)."""

    name = "round-robin"

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params, seed)
        self._next = 0

    def route(self, turn, view, now_s):
        i = self._next
        self._next = (i + 1) % self.num_replicas
        return i


class LeastLoaded(Router):
    """vLLM's data-parallel balancer: the lowest 4 x waiting + running, from the engines' last
    published counts, each raised by the requests sent since (as vLLM's client counts a request
    it sent as waiting until the next update)."""

    name = "least-loaded"
    scrapes_loads = True

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params, seed)
        self._sent_since: list[int] = [0] * num_replicas
        self._scrape_seen = -math.inf

    def route(self, turn, view, now_s):
        if view.scraped_s != self._scrape_seen:
            self._sent_since, self._scrape_seen = [0] * self.num_replicas, view.scraped_s
        scores = [4 * (ld.waiting + sent) + ld.running for ld, sent in zip(view.loads, self._sent_since)]
        i = self._argmin(scores)
        self._sent_since[i] += 1
        return i


@dataclass(frozen=True)
class SessionParams:
    """Args: virtual_nodes: points per replica on the hash ring."""

    virtual_nodes: int = 64

    def __post_init__(self) -> None:
        check_params("session router", self, counts=("virtual_nodes",))


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's own hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class SessionAffinity(Router):
    """Consistent hashing of the session (the agent job) onto a ring of replicas
    (production-stack's session router hashes a session header the same way): every turn of a job
    goes to one replica, whatever the load."""

    name = "session"
    Params = SessionParams

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params or SessionParams(), seed)
        ring = sorted((_stable_hash(f"replica-{k}-{v}"), k) for k in range(num_replicas)
                      for v in range(self.p.virtual_nodes))
        self._points = [h for h, _ in ring]
        self._owners = [k for _, k in ring]

    def route(self, turn, view, now_s):
        i = bisect.bisect(self._points, _stable_hash(turn.session)) % len(self._points)
        return self._owners[i]


class PrefixAware(Router):
    """production-stack's prefix-aware router: the replica whose record matches the longest prefix
    of the prompt; among equal matches (none at all included) the one with the fewest turns in
    flight (ours: the fallback is not specified there)."""

    name = "prefix"

    def route(self, turn, view, now_s):
        matched = view.matched(turn, now_s)
        best = max(matched)
        return self._argmin([view.outstanding[i] if m == best else math.inf for i, m in enumerate(matched)])


@dataclass(frozen=True)
class LoadAwareParams:
    """Args: beta: weight of the load term against the matched share."""

    beta: float = 1.0

    def __post_init__(self) -> None:
        check_params("load-aware router", self, non_negative=("beta",))


class LoadAware(Router):
    """production-stack's load-aware prefix routing: the highest matched/prompt - beta x (load -
    mean) / max(1, mean), the load being the turns in flight on each replica."""

    name = "load-aware"
    Params = LoadAwareParams

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params or LoadAwareParams(), seed)

    def route(self, turn, view, now_s):
        prompt = max(len(turn.block_hashes), 1)
        loads = view.outstanding
        mean = sum(loads) / len(loads)
        scores = [m / prompt - self.p.beta * (load - mean) / max(1.0, mean)
                  for m, load in zip(view.matched(turn, now_s), loads)]
        return self._argmin([-s for s in scores])


@dataclass(frozen=True)
class CacheAwareParams:
    """Args (SGLang's router defaults): balance_abs_threshold, balance_rel_threshold: the load gap
    beyond which it balances instead; cache_threshold: the matched share that makes a cache hit."""

    balance_abs_threshold: float = 32.0
    balance_rel_threshold: float = 1.0001
    cache_threshold: float = 0.5

    def __post_init__(self) -> None:
        check_params("cache-aware router", self, non_negative=("balance_abs_threshold", "cache_threshold"),
                     positive=("balance_rel_threshold",))


class CacheAware(Router):
    """SGLang's cache-aware router: when the loads (turns in flight) are out of balance (max - min >
    32 and max > 1.0001 x min) the least loaded replica; else the best match if it covers more than
    half of the prompt, else the replica whose record is smallest (the most room to cache)."""

    name = "cache-aware"
    Params = CacheAwareParams

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params or CacheAwareParams(), seed)

    def route(self, turn, view, now_s):
        p, loads = self.p, view.outstanding
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs_threshold and hi > p.balance_rel_threshold * lo:
            return self._argmin(loads)
        matched = view.matched(turn, now_s)
        best = max(range(len(matched)), key=lambda i: (matched[i], -i))
        if matched[best] / max(len(turn.block_hashes), 1) > p.cache_threshold:
            return best
        return self._argmin([len(ix) for ix in view.prefixes])


@dataclass(frozen=True)
class ScorersParams:
    """Args (llm-d's default weights): prefix_weight, kv_weight, queue_weight."""

    prefix_weight: float = 3.0
    kv_weight: float = 2.0
    queue_weight: float = 2.0

    def __post_init__(self) -> None:
        check_params("scorers router", self, non_negative=("prefix_weight", "kv_weight", "queue_weight"))


class WeightedScorers(Router):
    """llm-d's scheduler: a weighted sum of scorers in [0, 1], the highest wins (ties at random):
    prefix (matched share of the prompt), KV utilisation (1 - the scraped share in use) and queue
    (scraped waiting, min-max normalised: the shortest queue scores 1)."""

    name = "scorers"
    Params = ScorersParams
    scrapes_loads = True

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params or ScorersParams(), seed)

    def route(self, turn, view, now_s):
        p = self.p
        prompt = max(len(turn.block_hashes), 1)
        waiting = [ld.waiting for ld in view.loads]
        w_hi, w_lo = max(waiting), min(waiting)
        scores = []
        for m, ld, w in zip(view.matched(turn, now_s), view.loads, waiting):
            queue = (w_hi - w) / (w_hi - w_lo) if w_hi > w_lo else 1.0
            scores.append(p.prefix_weight * m / prompt + p.kv_weight * (1.0 - ld.kv_usage) + p.queue_weight * queue)
        return self._argmin([-s for s in scores], random_ties=True)


@dataclass(frozen=True)
class KVCostParams:
    """Args (NVIDIA Dynamo's KV router): overlap_weight: a prefill block's cost against a decode
    block's; temperature: 0 picks the cheapest, above 0 draws from a softmax of the costs
    (normalised by the largest)."""

    overlap_weight: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        check_params("kv-cost router", self, non_negative=("overlap_weight", "temperature"))


class KVCost(Router):
    """Dynamo's KV router: cost = overlap_weight x the prompt blocks the replica would prefill (not in
    the router's record) + the blocks of the turns in flight there; the cheapest (ties at random),
    or a softmax draw at a temperature."""

    name = "kv-cost"
    Params = KVCostParams

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        super().__init__(num_replicas, params or KVCostParams(), seed)

    def route(self, turn, view, now_s):
        prompt = len(turn.block_hashes)
        costs = [self.p.overlap_weight * (prompt - m) + active
                 for m, active in zip(view.matched(turn, now_s), view.inflight_blocks)]
        if self.p.temperature <= 0:
            return self._argmin(costs, random_ties=True)
        top = max(max(costs), 1e-12)
        weights = [math.exp(-c / top / self.p.temperature) for c in costs]
        return self.rng.choices(range(len(costs)), weights=weights)[0]


@dataclass(frozen=True)
class RecordedParams:
    """Args: turns: a replay's turns.csv with a ``replica`` column (a live take's, say)."""

    turns: str = ""

    def __post_init__(self) -> None:
        from pathlib import Path

        if not self.turns or not Path(self.turns).is_file():
            raise ConfigError(f"recorded router: turns={self.turns!r} is not a replay's turns.csv")


class Recorded(Router):
    """Every turn to the replica a recorded replay sent it to (a diagnostic: the simulator on a live
    take's own routes separates the engines' error from routes that went another way)."""

    name = "recorded"
    Params = RecordedParams

    def __init__(self, num_replicas: int, params=None, seed: int = 0) -> None:
        import csv

        super().__init__(num_replicas, params, seed)
        if params is None:  # the name alone (a listing, --help): nothing to follow yet
            self._routes: dict = {}
            return
        with open(params.turns, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or "replica" not in rows[0]:
            raise ConfigError(f"recorded router: {params.turns} has no replica column (not a cluster replay)")
        self._routes = {(r["job_id"], int(r["turn"])): int(r["replica"]) for r in rows}
        if max(self._routes.values()) >= num_replicas:
            raise ConfigError(f"recorded router: {params.turns} routes to replica {max(self._routes.values())}, "
                              f"beyond the {num_replicas} here")

    def route(self, turn, view, now_s):
        k = self._routes.get((turn.session, turn.turn))
        if k is None:
            raise ConfigError(f"recorded router: turn {turn.turn} of job {turn.session} is not in the recorded turns")
        return k


ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (
    RoundRobin, LeastLoaded, SessionAffinity, PrefixAware, LoadAware, CacheAware, WeightedScorers, KVCost, Recorded)}
ROUTER_NAMES = tuple(ROUTERS)


def make_router(name: str, num_replicas: int, params: dict | None = None, seed: int = 0) -> Router:
    """A new router by name, for ``num_replicas`` replicas, with parameters (only those it knows)."""
    if name not in ROUTERS:
        raise ConfigError(f"unknown router '{name}' (known: {', '.join(ROUTER_NAMES)})")
    cls = ROUTERS[name]
    params = dict(params or {})
    if cls.Params is None:
        if params:
            raise ConfigError(f"router '{name}' takes no parameters (got: {', '.join(sorted(params))})")
        return cls(num_replicas, None, seed)
    known = {f.name for f in fields(cls.Params)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"router '{name}' has no parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        return cls(num_replicas, cls.Params(**params), seed)
    except TypeError as exc:  # a value of the wrong type the checks did not name
        raise ConfigError(f"router '{name}': {exc}") from None
