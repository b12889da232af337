"""Prefill/decode disaggregation: P prefill instances hand each turn's KV cache to D decode
instances over a link (docs/cluster.md).

A turn is routed to its decode instance first (the router's own choice among the D instances), then,
unless what that instance is likely to miss is below ``threshold_tokens``, to a prefill instance,
which computes the prompt and one token. Its KV then crosses the link:

- ``reserve="before"`` (vLLM's NixlConnector: the decode instance pulls): the turn arrives at the
  decode instance when the prefill ends; admission reserves blocks for the whole prompt, looks its
  own prefix cache up, and loads the rest, whole blocks, asynchronously over the link while the
  batch runs; it then computes the prompt's last partial block and decodes. Bytes moved: what the
  decode instance missed.
- ``reserve="after"`` (a push into a staging buffer): the prefill instance sends the whole prompt's
  KV (it cannot know the decode instance's cache) as soon as it ends; the turn arrives at the
  decode instance when the transfer is done, and admission takes the staged blocks at once.

- ``link.kind == "file"`` (vLLM's ExampleConnector, the one this CPU build can run live): the
  prefill instance writes the prompt's whole blocks to a shared directory, a file per layer, unless
  a file of that whole-block prompt exists already (an earlier turn of the job whose prompt had the
  same whole blocks); the turn arrives when the write is done. The decode instance reserves blocks;
  if its own prefix cache misses any of the file's blocks it reads the whole file inside the step
  that admits the turn (synchronously: the step waits), else it reads nothing. Write and read are
  priced separately, from ``gpubench vllm kv-file-rate`` (``FileLinks``).

Transfer time = link latency + bytes / link bandwidth. With ``layerwise`` the prefill instance
sends each layer's KV as that layer finishes, so the transfer overlaps the prefill's compute: what
is left at its end is the larger of the last layer's share and what the overlap did not cover.
TTFT counts from the turn's arrival at the router: the prefill's queue and compute, the transfer,
the decode instance's queue and its first step.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError
from scheduling.engine.request import Request
from scheduling.policies.base import ExternalLoad

# Latency of one KV hand-off over each kind of link (one RDMA/NVLink transfer setup and its completion
# notice: a few microseconds on the wire; the transfers here take milliseconds, so this matters little).
LINK_LATENCY_S = {"nvlink": 5e-6, "network": 10e-6, "pcie": 10e-6}
LINK_KINDS = ("auto", *LINK_LATENCY_S, "file")
RESERVE_MODES = ("before", "after")
PREFIX_CACHING = ("both", "prefill", "decode", "none")


@dataclass(frozen=True)
class KVLink:
    """The link a turn's KV cache takes from a prefill GPU to a decode GPU, per direction."""

    kind: str
    gbs: float
    latency_s: float
    source: str

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / (self.gbs * 1e9)


@dataclass(frozen=True)
class FileLinks:
    """The file connector's two halves, each ``latency + bytes / bandwidth`` as measured on the host
    that runs it (``gpubench vllm kv-file-rate``)."""

    write: KVLink
    read: KVLink

    @classmethod
    def load(cls, path: str) -> "FileLinks":
        """From a ``kv_file_rate.json``; one ConfigError line if it is not one."""
        from common.jsonio import read_json

        record = read_json(path, what="a kv_file_rate.json (gpubench vllm kv-file-rate --out DIR)")
        try:
            write, read = (KVLink("file", float(record[k]["gbs"]), float(record[k]["latency_s"]),
                                  f"{k}, measured: {path}") for k in ("write", "read"))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: no write and read rates (gbs, latency_s) in it; make it with "
                              "gpubench vllm kv-file-rate --out DIR") from None
        if not all(x.gbs > 0 and x.latency_s >= 0 for x in (write, read)):
            raise ConfigError(f"{path}: a rate must be > 0 GB/s and a latency >= 0 s")
        return cls(write, read)


def kv_link(sku, kind: str = "auto", gbs: float | None = None, latency_s: float | None = None) -> KVLink:
    """The SKU table's link of ``kind`` (``auto``: NVLink where the part has it, else its per-GPU
    network, else PCIe); ``gbs`` overrides the bandwidth, ``latency_s`` the fixed cost of a hand-off
    (a file-based connector's folder and per-layer files cost milliseconds, not microseconds)."""
    if kind not in LINK_KINDS or kind == "file":
        raise ConfigError(f"kv_link must be one of {', '.join(LINK_KINDS[:-1])} here, got {kind!r}")
    table = {"nvlink": sku.nvlink_gbs, "network": sku.nic_gbs, "pcie": sku.host_link_gbs}
    if kind == "auto":
        kind = next((k for k in ("nvlink", "network", "pcie") if table[k]), "pcie")
    latency = LINK_LATENCY_S[kind] if latency_s is None else float(latency_s)
    if gbs is not None:
        return KVLink(kind, float(gbs), latency, "kv_link_gbs (given)")
    if not table[kind]:
        raise ConfigError(f"{sku.id} has no {kind} bandwidth in the SKU table; give its bandwidth "
                          f"(--kv-link-gbs, kv_link_gbs=...)")
    field = {"nvlink": "nvlink_gbs", "network": "nic_gbs", "pcie": "host_link_gbs"}[kind]
    return KVLink(kind, float(table[kind]), latency, f"{sku.id} {field}: {sku.source.get(field, 'SKU table')}")


@dataclass(frozen=True)
class PDSettings:
    """Args:
        prefill_replicas: prefill instances (the decode instances are the cluster's replicas).
        link: the KV link.
        layerwise: send each layer's KV as it is computed (overlap with the prefill).
        reserve: ``before``: the decode instance reserves blocks, then pulls; ``after``: it takes
            KV already pushed to it (module docstring).
        threshold_tokens: a turn whose prompt the decode instance is likely to miss by fewer tokens
            (the router's record of what it sent there) is prefilled there, not remotely.
        prefix_caching: which side looks prefixes up (``both``, ``prefill``, ``decode``, ``none``).
        files: with a ``file`` link, its measured write and read halves.
    """

    prefill_replicas: int
    link: KVLink
    layerwise: bool = False
    reserve: str = "before"
    threshold_tokens: int = 0
    prefix_caching: str = "both"
    files: FileLinks | None = None

    def caches(self, role: str) -> bool:
        return self.prefix_caching in ("both", role)


@dataclass
class PendingKV:
    """A turn's KV on its prefill instance, waiting for the decode instance."""

    arrival_s: float          # the turn's arrival at the router
    prefill_start_s: float    # its prefill's first step
    prefill_end_s: float
    prompt_tokens: int
    consumed: bool = False    # loaded once: a later lookup (after a preemption) recomputes


class RemotePrefill:
    """The decode instance's source of tokens beyond its GPU hit (a ``KVSource``): the prefill
    instance's KV of turns handed to it, loaded asynchronously (over a link) or inside the admitting
    step (from a file)."""

    def __init__(self, settings: PDSettings, kv_bytes_per_token: int, num_layers: int, transfers: list,
                 block_size: int = 16) -> None:
        self.s = settings
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_layers = max(num_layers, 1)
        self.block_size = block_size
        self.asynchronous_load = settings.files is None
        self.pending: dict[tuple[int, int], PendingKV] = {}
        self.transfers = transfers  # the cluster's log: (job_id, turn, bytes, start_s, seconds)
        self.files: set[tuple[int, int]] = set()  # (job, tokens): the whole-block prompts written (file link)

    def write_file_s(self, req: Request) -> float:
        """A file link: the prefill instance's write of ``req``'s whole-block prompt, in seconds (0:
        the connector found a file of it; its lookup key drops one more token than its store does)."""
        n, bs, j = req.prompt_tokens, self.block_size, req.job_state.index
        if (j, (n - 2) // bs * bs) in self.files:
            return 0.0
        stored = (n - 1) // bs * bs
        self.files.add((j, stored))
        return self.s.files.write.transfer_s(stored * self.kv_bytes_per_token)  # type: ignore[union-attr]

    def external_hit(self, req: Request, gpu_hit_tokens: int, max_tokens: int) -> int:
        p = self.pending.get((req.job_state.index, req.turn))
        if p is None or p.consumed:
            return 0
        if self.s.files is not None:  # what the file holds beyond the local hit, if a file is found
            found = (req.prompt_tokens - 2) // self.block_size * self.block_size
            return max(min(found, max_tokens) - gpu_hit_tokens, 0) if (req.job_state.index, found) in self.files else 0
        return max(max_tokens - gpu_hit_tokens, 0)  # both whole blocks

    def load_external(self, req: Request, gpu_hit_tokens: int, num_tokens: int, now_s: float) -> ExternalLoad:
        p = self.pending[(req.job_state.index, req.turn)]
        p.consumed = True
        if self.s.reserve == "after":  # pushed and staged before the turn arrived here
            return ExternalLoad(0.0)
        if self.s.files is not None:  # the whole file is read back, whatever the local hit covered
            num_bytes = (req.prompt_tokens - 1) // self.block_size * self.block_size * self.kv_bytes_per_token
            seconds = self.s.files.read.transfer_s(num_bytes)
            self.transfers.append((req.job_state.job.job_id, req.turn, num_bytes, now_s, seconds))
            return ExternalLoad(seconds)
        num_bytes = num_tokens * self.kv_bytes_per_token
        seconds = self.transfer_left_s(num_bytes, p, now_s)
        self.transfers.append((req.job_state.job.job_id, req.turn, num_bytes, now_s, seconds))
        return ExternalLoad(seconds)

    def transfer_left_s(self, num_bytes: float, p: PendingKV, start_s: float) -> float:
        """Seconds the transfer still takes from ``start_s`` (layer-wise: what the overlap with the
        prefill did not cover, at least the last layer's share)."""
        full = self.s.link.transfer_s(num_bytes)
        if not self.s.layerwise:
            return full
        return max(full - (start_s - p.prefill_start_s), self.s.link.latency_s + (full - self.s.link.latency_s) / self.num_layers)


def check_pd_settings(policy: str, prefill_replicas: int, *, kv_link: str, kv_reserve: str, pd_threshold_tokens: int,
                      pd_prefix_caching: str, kv_link_gbs: float | None, kv_link_latency_s: float | None = None,
                      kv_file_rate: str | None = None, kv_layerwise: bool = False) -> None:
    """The disaggregation settings of a replay config: one ConfigError naming the first bad one."""
    import math

    from scheduling.policies import make_policy
    from scheduling.policies.base import KVPolicy

    if isinstance(prefill_replicas, bool) or not isinstance(prefill_replicas, int) or prefill_replicas < 0:
        raise ConfigError(f"prefill_replicas must be an integer >= 0, got {prefill_replicas!r}")
    if kv_link not in LINK_KINDS:
        raise ConfigError(f"kv_link must be one of {', '.join(LINK_KINDS)}, got {kv_link!r}")
    if kv_reserve not in RESERVE_MODES:
        raise ConfigError(f"kv_reserve must be one of {', '.join(RESERVE_MODES)}, got {kv_reserve!r}")
    if pd_prefix_caching not in PREFIX_CACHING:
        raise ConfigError(f"pd_prefix_caching must be one of {', '.join(PREFIX_CACHING)}, got {pd_prefix_caching!r}")
    if isinstance(pd_threshold_tokens, bool) or not isinstance(pd_threshold_tokens, int) or pd_threshold_tokens < 0:
        raise ConfigError(f"pd_threshold_tokens must be an integer >= 0, got {pd_threshold_tokens!r}")
    if kv_link_gbs is not None and (isinstance(kv_link_gbs, bool) or not isinstance(kv_link_gbs, (int, float))
                                    or not (math.isfinite(kv_link_gbs) and kv_link_gbs > 0)):
        raise ConfigError(f"kv_link_gbs must be a finite number > 0, got {kv_link_gbs!r}")
    if kv_link_latency_s is not None and (isinstance(kv_link_latency_s, bool)
                                          or not isinstance(kv_link_latency_s, (int, float))
                                          or not (math.isfinite(kv_link_latency_s) and kv_link_latency_s >= 0)):
        raise ConfigError(f"kv_link_latency_s must be a finite number >= 0, got {kv_link_latency_s!r}")
    if kv_link == "file":
        if kv_file_rate is None:
            raise ConfigError("kv_link file needs the host's measured rates: --kv-file-rate PATH "
                              "(gpubench vllm kv-file-rate --out DIR writes DIR/kv_file_rate.json)")
        if kv_link_gbs is not None or kv_link_latency_s is not None or kv_reserve != "before" or kv_layerwise:
            raise ConfigError("kv_link file is priced from --kv-file-rate alone: drop --kv-link-gbs, "
                              "--kv-link-latency-s, --kv-reserve and --kv-layerwise")
    elif kv_file_rate is not None:
        raise ConfigError("--kv-file-rate prices vLLM's file connector: add --kv-link file")
    if prefill_replicas and type(make_policy(policy)).external_hit is not KVPolicy.external_hit:
        raise ConfigError(f"policy '{policy}' loads KV from its own pool; a disaggregated decode instance loads it "
                          "from the prefill instance (use fcfs, sjf, las, jitserve or continuum)")
