"""``continuum-offload``: Continuum's TTL pins in GPU memory, with CPU offload behind them.

The two mechanisms are complementary: a pin keeps a job's KV on the GPU across a tool call that
is expected to be short, and the host pool keeps a copy of every turn's blocks, so a job whose pin
expired (a long tool call) or was released under memory pressure reloads its prefix over the host
link instead of recomputing it. Queue order, preemption victims and pin release are Continuum's
(:mod:`scheduling.policies.continuum`); stores, loads and their link costs are cpu-offload's
(:mod:`scheduling.policies.cpu_offload`). A pinned turn's store still uses the link; its blocks
are freed when the pin is released (approximation: a release does not wait for a copy still
running).
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduling.engine.request import Request
from scheduling.policies.base import PolicyContext
from scheduling.policies.continuum import ContinuumParams, ContinuumPolicy
from scheduling.policies.cpu_offload import CPUOffloadParams, HostBlockPool, HostPoolMixin


@dataclass(frozen=True)
class ContinuumOffloadParams(ContinuumParams, CPUOffloadParams):
    """Every parameter of continuum and of cpu-offload (same names, same defaults)."""

    def __post_init__(self) -> None:  # both parents' checks (the MRO would run only the first)
        ContinuumParams.__post_init__(self)
        CPUOffloadParams.__post_init__(self)


class ContinuumOffloadPolicy(HostPoolMixin, ContinuumPolicy):
    name = "continuum-offload"
    asynchronous_load = True

    def __init__(self, params: ContinuumOffloadParams | None = None) -> None:
        params = params or ContinuumOffloadParams()
        super().__init__(params)
        self.host = HostBlockPool(params)

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self.host.attach(ctx)

    def on_turn_finish(self, req: Request, now_s: float) -> bool:
        stored_s = self.host.store(req, now_s)  # every turn's KV goes to the host, pinned or not
        if not super().on_turn_finish(req, now_s):
            return False  # pinned: the pin's release frees the blocks
        return self.free_when_stored(req, now_s, stored_s)

    def reload_s(self, context_tokens: int) -> float:
        """Reloading from the host pool when it is cheaper than recomputing (bytes / bandwidth)."""
        return min(super().reload_s(context_tokens), self.host.reload_s(context_tokens))

    def stats(self) -> dict:
        return {**super().stats(), **self.host_stats()}
