"""Protocol and task names and the protocols' default knobs: constants only, so that the CLI can
list them in `--help` without importing torch (kvcomm.protocols) or building tasks."""

from dataclasses import dataclass

PROTOCOLS = ("text", "kv-verbatim", "kv-rerotated", "kv-rerotated+boundary", "remote-prefill", "kv-blend",
             "remote-prefill+blend", "kv-anchored", "kv-anchored+boundary", "kv-own-anchored", "kv-own-anchored-once",
             "kv-layers", "placebo")
# What ``remote-prefill`` was called until 2026-12-06. It ships K/V the sender computed by prefilling the
# message again in B's frame: a function of the message text and B's frame only, so B's prompt gives
# exactly text's answers. That is a remote prefill, not reuse of the sender's cache: it is reported
# as a reference row and never judged against the goal. The old names are still accepted, and rows
# written under them are read under the new ones.
OLD_NAMES = {"kv-reencoded": "remote-prefill", "kv-reencoded+blend": "remote-prefill+blend"}


def canonical(name: str) -> str:
    """A protocol name under its current spelling (``kv-reencoded`` -> ``remote-prefill``)."""
    return OLD_NAMES.get(name, name)


def canonical_label(label: str) -> str:
    """A result row's protocol label (name and parameters) under the current name."""
    name, sep, params = label.partition(" ")
    return canonical(name) + sep + params


@dataclass(frozen=True)
class ProtocolFeatures:
    """What a protocol does, read off its name (``text`` or ``kv-BASE[+boundary|+blend]``).

    Attributes:
        ships_kv: the sender hands over K/V of its message span (False: the text, which B prefills).
        reencoded: the shipped span was re-encoded by the sender in B's frame (kvcomm.protocols.
            reencode_in_receiver_frame): ``remote-prefill``, ``kv-anchored`` and their variants. Such
            K/V are not the sender's own cache: judged as references, never against the goal.
        repositions: B rotates the span's keys to the positions it takes in B's prompt (all but
            ``kv-verbatim``, which imports the keys as they were).
        anchored: anchor offsets estimated from other examples are added to a later sender's
            re-encoded span (kvcomm.anchors); without ``reencoded`` (``kv-own-anchored``, KVCOMM
            proper) to every sender's own re-rotated span, with a prefill fallback when no anchor matches.
        search_once: an anchored protocol finds each token's nearest anchors at one layer and every
            layer reuses them (``kv-own-anchored-once``), instead of searching at every layer.
        layer_share: KVComm's (KTH) selective layer sharing (``kv-layers``): the sender's own span,
            re-rotated into place, at a share of the layers chosen by attention importance on
            calibration examples; at the others B's tokens do not see the message (kvcomm.layer_share).
        boundary: B recomputes the first k tokens of a span (one run per ``--boundary-k``); of every
            span, or only a later sender's when the span was re-encoded in B's frame (the first
            sender's is then exact).
        blend: CacheBlend's selective recompute of a ratio of the imported tokens (one run per ``--ratio``).
        placebo: text's own K/V with noise of kv-rerotated's KL on the example (kvcomm.placebo): the
            flip floor, never judged.
    """

    ships_kv: bool
    reencoded: bool = False
    repositions: bool = False
    anchored: bool = False
    search_once: bool = False
    layer_share: bool = False
    boundary: bool = False
    blend: bool = False
    placebo: bool = False

    @property
    def reference(self) -> bool:
        """A reference row, never judged against the goal: the shipped K/V were computed by an extra
        prefill in B's frame, not taken from the sender's own cache (or it is the placebo)."""
        return self.placebo or (self.ships_kv and self.reencoded)

    def recomputes_head(self, sender_index: int) -> bool:
        """Whether B recomputes the head of sender ``sender_index``'s span."""
        return self.boundary and (not self.reencoded or sender_index > 0)


# keyed by the name without its "kv-" prefix and "+suffix": remote-prefill is the one base without "kv-"
_BASES = {"verbatim": {}, "rerotated": {"repositions": True}, "remote-prefill": {"reencoded": True, "repositions": True},
          "anchored": {"reencoded": True, "repositions": True, "anchored": True}, "blend": {"blend": True},
          "own-anchored": {"repositions": True, "anchored": True},
          "own-anchored-once": {"repositions": True, "anchored": True, "search_once": True},
          "layers": {"repositions": True, "layer_share": True}}
_SUFFIXES = {"": {}, "boundary": {"boundary": True}, "blend": {"blend": True}}


def protocol_features(name: str) -> ProtocolFeatures:
    """The features of a protocol named in PROTOCOLS (KeyError for any other name)."""
    name = canonical(name)
    if name not in PROTOCOLS:
        raise KeyError(name)
    if name in ("text", "placebo"):
        return ProtocolFeatures(ships_kv=False, placebo=name == "placebo")
    base, _, suffix = name.removeprefix("kv-").partition("+")
    return ProtocolFeatures(ships_kv=True, **_BASES[base], **_SUFFIXES[suffix])


DEFAULT_BOUNDARY_K = 8
DEFAULT_RATIO = 0.15
DEFAULT_ANCHOR_EXAMPLES = 40  # kv-anchored's pool, kv-layers' calibration: examples of another seed, never scored
# Anchor examples come from the run's seed plus this offset, so they are never among the scored examples.
ANCHOR_SEED_OFFSET = 1_000_003
TASK_NAMES = ("keycode", "twoagent", "drift", "drift3", "multihop", "summary", "handoff", "handoff2")
# Chance per task: the share a receiver would get right picking uniformly among the answers its notes
# offer (kvcomm.tasks says which); None for free text scored by ROUGE-L. Text must beat it (by its
# exact one-sided bound) before any protocol is judged against text (kvcomm.metrics.above_chance).
TASK_CHANCE: dict[str, float | None] = {"keycode": 1 / 4, "twoagent": 1 / 6, "drift": 1 / 4, "drift3": 1 / 6,
                                        "multihop": 1 / 3, "summary": None, "handoff": 1 / 5, "handoff2": 1 / 5}
# The link an end-to-end time moves a message over: 100 Gb/s (12.5 GB/s), a datacenter NIC per GPU
# class; K/V at bf16, the dtype a GPU engine would ship, text as UTF-8 (kvcomm eval and kvcomm ttft).
E2E_LINK_GBS = 12.5
