"""Each router's contract: who gets the turn and why, on a hand-set view (what the router knows) and
on hand-built traces through real engines (scheduling.cluster)."""
import pytest

from common.errors import ConfigError
from scheduling.cluster.routers import ROUTER_NAMES, make_router
from scheduling.cluster.view import ClusterView, PrefixIndex, ReplicaLoad, TurnToRoute


def view(n=3, *, loads=None, outstanding=None, capacity=1000):
    v = ClusterView(n, prefix_capacity_blocks=[capacity] * n)
    if loads is not None:
        v.set_loads([ReplicaLoad(w, r, u, 100) for w, r, u in loads], 0.0)
    if outstanding is not None:
        v.outstanding = list(outstanding)
    return v


def turn(session="a", blocks=10, prefix="p"):
    return TurnToRoute(session, 0, blocks * 16, [(prefix, i) for i in range(blocks)])


def send(v, replica, t, now=0.0):
    """The router sent ``t`` to ``replica``; the turn is done (only the prefix record stays)."""
    v.sent(replica, t, now)
    v.finished(replica, len(t.block_hashes))


def test_round_robin_cycles():
    r = make_router("round-robin", 3)
    assert [r.route(turn(), view(), 0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_scores_four_waiting_per_running_and_counts_what_it_sent_since_the_last_update():
    r = make_router("least-loaded", 3)
    v = view(loads=[(1, 0, 0), (0, 3, 0), (0, 5, 0)])  # scores 4, 3, 5
    assert r.route(turn(), v, 0.0) == 1
    # the same stale numbers: the request it just sent counts as waiting on 1 (score 7), so 0 (4) next
    assert r.route(turn(), v, 0.0) == 0
    assert r.route(turn(), v, 0.0) == 2  # 0 is at 8 now, 2 at 5
    v.set_loads([(ReplicaLoad(1, 0, 0, 100)), ReplicaLoad(0, 3, 0, 100), ReplicaLoad(0, 5, 0, 100)], 1.0)
    assert r.route(turn(), v, 1.0) == 1  # a fresh update replaces its own counts


def test_session_keeps_a_job_on_one_replica_and_moves_few_jobs_when_a_replica_is_added():
    three, four = make_router("session", 3), make_router("session", 4)
    sessions = [f"job-{i}" for i in range(400)]
    first = {s: three.route(turn(s), view(3), 0.0) for s in sessions}
    assert all(three.route(turn(s), view(3), 9.0) == first[s] for s in sessions)  # sticky
    assert {0, 1, 2} == set(first.values())
    moved = sum(four.route(turn(s), view(4), 0.0) != first[s] for s in sessions)
    assert moved < 0.45 * len(sessions)  # consistent hashing: ~1/4 move, not ~3/4 as with a modulus


def test_prefix_goes_where_the_longest_prefix_was_sent_and_else_to_the_least_busy():
    r = make_router("prefix", 3)
    v = view(outstanding=[2, 0, 1])
    assert r.route(turn(prefix="new"), v, 0.0) == 1  # no match anywhere: fewest in flight
    send(v, 2, turn(blocks=4))
    send(v, 0, turn(blocks=8))
    assert r.route(turn(blocks=10), v, 1.0) == 0  # 8 blocks beat 4
    assert r.route(turn(blocks=3), v, 1.0) == 2  # both match all 3: 2 has fewer in flight than 0


def test_load_aware_trades_the_matched_share_for_load_above_the_mean():
    r = make_router("load-aware", 2)
    v = view(2, outstanding=[1, 1])
    send(v, 0, turn(blocks=10))
    assert r.route(turn(blocks=10), v, 0.0) == 0  # 1.0 - 0 against 0 - 0
    v.outstanding = [4, 0]  # mean 2: replica 0 scores 1 - (4 - 2) / 2 = 0, replica 1: 0 + 1
    assert r.route(turn(blocks=10), v, 0.0) == 1
    soft = make_router("load-aware", 2, {"beta": 0.25})
    assert soft.route(turn(blocks=10), v, 0.0) == 0  # 1 - 0.25 against 0.25


def test_cache_aware_balances_past_its_thresholds_else_follows_a_majority_match_else_the_smallest_record():
    r = make_router("cache-aware", 3)
    v = view(outstanding=[40, 5, 6])
    send(v, 0, turn(blocks=10))
    assert r.route(turn(blocks=10), v, 0.0) == 1  # 40 - 5 > 32 and 40 > 1.0001 x 5: least loaded
    v.outstanding = [20, 5, 6]  # in balance: the match (10 of 10 > half) wins
    assert r.route(turn(blocks=10), v, 0.0) == 0
    send(v, 1, turn(blocks=2, prefix="q"))
    # a new prompt matching 0 %: the replica whose record is smallest (2 has none)
    assert r.route(turn(blocks=10, prefix="z"), v, 0.0) == 2
    # half or less is no hit
    assert r.route(TurnToRoute("b", 0, 320, [("p", i) for i in range(5)] + [("x", i) for i in range(5)]), v, 0.0) == 2


def test_scorers_weigh_prefix_kv_and_queue_as_llm_d_does():
    r = make_router("scorers", 3)
    # replica 0: the prefix (3 x 1.0) but a full KV cache and the longest queue; 1: empty; 2: half full
    v = view(loads=[(4, 0, 100), (0, 0, 0), (2, 0, 50)])
    send(v, 0, turn(blocks=10))
    assert r.route(turn(blocks=10), v, 0.0) == 1  # 0: 3 + 0 + 0 = 3; 1: 0 + 2 + 2 = 4; 2: 0 + 1 + 1 = 2
    prefix_heavy = make_router("scorers", 3, {"prefix_weight": 5.0})
    assert prefix_heavy.route(turn(blocks=10), v, 0.0) == 0  # 5 against 4


def test_scorers_break_ties_at_random_but_reproducibly():
    v = view(loads=[(0, 0, 0)] * 3)
    picks = [make_router("scorers", 3, seed=s).route(turn(), v, 0.0) for s in range(12)]
    assert len(set(picks)) > 1
    assert picks == [make_router("scorers", 3, seed=s).route(turn(), v, 0.0) for s in range(12)]


def test_kv_cost_adds_blocks_to_prefill_to_blocks_in_flight():
    r = make_router("kv-cost", 2)
    v = view(2)
    send(v, 0, turn(blocks=10))
    v.inflight_blocks = [6, 0]
    assert r.route(turn(blocks=10), v, 0.0) == 0  # 0 + 6 against 10 + 0
    v.inflight_blocks = [11, 0]
    assert r.route(turn(blocks=10), v, 0.0) == 1  # 11 against 10
    cheap_prefill = make_router("kv-cost", 2, {"overlap_weight": 0.5})
    assert cheap_prefill.route(turn(blocks=10), v, 0.0) == 1  # 11 against 5
    warm = make_router("kv-cost", 2, {"temperature": 1.0}, seed=3)
    picks = {warm.route(turn(blocks=10), v, 0.0) for _ in range(50)}
    assert picks == {0, 1}  # a softmax draw, not the argmin


def test_the_prefix_record_keeps_a_prefix_through_expiry_and_eviction():
    ix = PrefixIndex(capacity_blocks=5, ttl_s=10.0)
    ix.record([1, 2, 3, 4], 0.0)
    assert ix.matched_blocks([1, 2, 3, 4, 5], 5.0) == 4
    ix.record([1, 2, 9], 4.0)  # 1, 2 refreshed; 5 blocks held: 4, then 3, are the oldest
    ix.record([7], 4.5)       # one over capacity: the tail of the old chain goes first
    assert ix.matched_blocks([1, 2, 3, 4], 5.0) == 3
    assert ix.matched_blocks([1, 2, 3, 4], 12.0) == 2  # 3 expired (sent at 0), 1 and 2 (at 4) not yet
    assert ix.matched_blocks([1, 2], 14.5) == 0


def test_recorded_follows_a_replays_routes(tmp_path):
    path = tmp_path / "turns.csv"
    path.write_text("job_id,turn,replica\na,0,1\na,1,0\nb,0,1\n")
    r = make_router("recorded", 2, {"turns": str(path)})
    assert [r.route(TurnToRoute(j, t, 16, []), view(2), 0.0) for j, t in (("a", 0), ("a", 1), ("b", 0))] == [1, 0, 1]
    with pytest.raises(ConfigError, match="turn 2 of job a is not in the recorded turns"):
        r.route(TurnToRoute("a", 2, 16, []), view(2), 0.0)
    with pytest.raises(ConfigError, match="beyond the 1 here"):
        make_router("recorded", 1, {"turns": str(path)})
    (tmp_path / "single.csv").write_text("job_id,turn\na,0\n")
    with pytest.raises(ConfigError, match="no replica column"):
        make_router("recorded", 2, {"turns": str(tmp_path / "single.csv")})


@pytest.mark.parametrize("name, params, message", [
    ("nope", {}, "unknown router 'nope'"),
    ("round-robin", {"x": 1}, "takes no parameters"),
    ("session", {"virtual_nodes": 0}, "virtual_nodes must be a whole number >= 1"),
    ("load-aware", {"beta": -1}, "beta must be a finite number >= 0"),
    ("kv-cost", {"temp": 1}, "has no parameter(s) temp"),
])
def test_bad_router_settings_are_one_clear_error(name, params, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_router(name, 2, params)


def test_every_router_has_a_contract_test_here():
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    assert all(f'"{name}"' in source for name in ROUTER_NAMES)
