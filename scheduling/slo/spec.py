"""The SLO kinds an agent job has, and ``--slo`` parsing.

A multi-turn agent job is a chain of turns, each ending in a tool call but the last. What a user
of such an agent waits on, and so what it can be promised:

- ``ttft``: a turn's time to first token (arrival to the step that completes its prefill), where the
  turn is streamed to a person;
- ``tpot``: a streamed turn's time per output token after the first;
- ``tool_turn``: a deadline on a turn whose output triggers a tool (arrival to its last token): the
  tool cannot start before the whole call is out, so its streaming speed matters less than when
  it ends (JITServe's time-to-last-token target, 10 s, for the same reason);
- ``job``: a deadline on the whole job, arrival to the last turn's last token. It includes the
  tool gaps, which the engine does not control: a target well above the job's total tool time.

Defaults: TTFT 2 s and TPOT 0.1 s (the replay summary's interactive target, a common one), a tool
turn 10 s (JITServe), no job deadline (agent jobs run from seconds to hours: set one per workload).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from common.errors import ConfigError

KINDS = ("ttft", "tpot", "tool_turn", "job")


@dataclass(frozen=True)
class SLOSpec:
    """Targets in seconds; ``None`` leaves a kind out (every turn or job meets it)."""

    ttft_s: float | None = 2.0
    tpot_s: float | None = 0.1
    tool_turn_s: float | None = 10.0
    job_s: float | None = None

    def __post_init__(self) -> None:
        for kind in KINDS:
            v = getattr(self, f"{kind}_s")
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v))):
                raise ConfigError(f"--slo {kind}: a target must be a finite number of seconds > 0, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{k} <= {getattr(self, k + '_s'):g} s" for k in KINDS if getattr(self, k + "_s") is not None]
        return ", ".join(parts) if parts else "no targets"


DEFAULT_SLO = SLOSpec()


def parse_slo(text: str | None) -> SLOSpec:
    """``ttft=1,tpot=0.05,tool_turn=10,job=600`` (seconds; ``KIND=none`` drops a kind; kinds not
    named keep their defaults). Empty or None: the defaults."""
    if not text:
        return DEFAULT_SLO
    values = DEFAULT_SLO.to_dict()
    named: set[str] = set()
    for item in text.split(","):
        key, sep, raw = item.strip().partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in KINDS:
            raise ConfigError(f"--slo {item.strip()!r}: expected KIND=SECONDS with KIND one of {', '.join(KINDS)}")
        if key in named:
            raise ConfigError(f"--slo names {key} twice ({text!r}): give each kind once")
        named.add(key)
        if raw.strip().lower() in ("none", "off"):
            values[f"{key}_s"] = None
            continue
        try:
            values[f"{key}_s"] = float(raw)
        except ValueError:
            raise ConfigError(f"--slo {key}={raw!r}: not a number of seconds (or 'none')") from None
    return SLOSpec(**values)


def add_slo_option(p, default_text: str = "ttft=2,tpot=0.1,tool_turn=10, no job deadline") -> None:
    """``--slo`` on an argparse parser (``gpubench replay``, ``gpubench slo predict``/``check``)."""
    p.add_argument("--slo", default=None, metavar="KIND=S,...",
                   help="SLO targets in seconds: ttft, tpot, tool_turn (a turn that triggers a tool, arrival to last "
                        "token), job (arrival to the job's last token, tool time included); KIND=none drops one; "
                        f"kinds not named keep ttft=2,tpot=0.1,tool_turn=10 (default: {default_text})")
