"""Protocol and task names and the protocols' default knobs: constants only, so that the CLI can
list them in `--help` without importing torch (kvcomm.protocols) or building tasks."""

PROTOCOLS = ("text", "kv-verbatim", "kv-rerotated", "kv-rerotated+boundary", "kv-reencoded", "kv-blend",
             "kv-reencoded+blend", "kv-anchored", "kv-anchored+boundary")
# protocols that take one run per --ratio value (CacheBlend's recompute share)
BLEND_PROTOCOLS = ("kv-blend", "kv-reencoded+blend")
# protocols that ship the span the sender re-encoded in B's frame (protocols.reencode_in_receiver_frame)
REENCODED_PROTOCOLS = ("kv-reencoded", "kv-reencoded+blend", "kv-anchored", "kv-anchored+boundary")
# protocols that add anchor offsets to a later sender's re-encoded span (kvcomm.anchors)
ANCHORED_PROTOCOLS = ("kv-anchored", "kv-anchored+boundary")
# protocols that take one run per --boundary-k value (tokens at the head of a span that B recomputes)
BOUNDARY_PROTOCOLS = ("kv-rerotated+boundary", "kv-anchored+boundary")
DEFAULT_BOUNDARY_K = 8
DEFAULT_RATIO = 0.15
DEFAULT_ANCHOR_EXAMPLES = 40  # kv-anchored's pool: examples of another seed, never scored
# Anchor examples come from the run's seed plus this offset, so they are never among the scored examples.
ANCHOR_SEED_OFFSET = 1_000_003
TASK_NAMES = ("keycode", "twoagent", "drift", "drift3", "multihop", "summary")
