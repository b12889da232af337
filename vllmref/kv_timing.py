"""vLLM's ExampleConnector with its file I/O timed (runs inside the vLLM environment).

A live prefill/decode pair on this host moves KV through vLLM's debug ``ExampleConnector``: the
producer writes each new request's whole-block prompt KV, one safetensors file per layer, inside its
forward pass (``save_kv_layer``, after each layer's attention); the consumer reads the whole file
back into its paged cache before its forward pass (``start_load_kv``). Both are synchronous, so the
transfer is inside the two engines' steps and cannot be read off the step times. This subclass
changes nothing the connector does; it only records, per engine step, which requests were stored or
loaded (with their tokens) and the seconds spent in the two calls, for the worker to report
(``vllmref.worker_serve``'s ``kv`` event). The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the scheduler-side and worker-side halves share
``STEP``.
"""
from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from vllmref.hooks import external_id

# This step's records: requests in the order the connector's metadata lists them, and seconds.
STEP: dict = {"requests": [], "save_s": 0.0, "load_s": 0.0}


def drain() -> dict | None:
    """This step's record (``None`` when the connector did nothing), and a fresh one begun."""
    if not STEP["requests"] and not STEP["save_s"] and not STEP["load_s"]:
        return None
    out = {"requests": list(STEP["requests"]), "save_s": STEP["save_s"], "load_s": STEP["load_s"]}
    STEP.update(requests=[], save_s=0.0, load_s=0.0)
    return out


class TimedExampleConnector(ExampleConnector):
    """``ExampleConnector``, with what it stores and loads, and how long that takes, recorded."""

    def build_connector_meta(self, scheduler_output):  # scheduler side, once per step
        need_load = set(self._requests_need_load)
        meta = super().build_connector_meta(scheduler_output)
        # The parent lists new requests in scheduled order, each a load (it found the producer's
        # file) or a store (no file yet); its ReqMeta carries no id, so the ids are matched here.
        stored = iter(r for r in meta.requests if r.is_store)
        loaded = iter(r for r in meta.requests if not r.is_store)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in need_load:
                STEP["requests"].append({"id": external_id(new.req_id), "op": "load", "tokens": len(next(loaded).slot_mapping)})
            elif not self._found_match_for_prompt(new.prompt_token_ids or [], [f.identifier for f in new.mm_features]):
                STEP["requests"].append({"id": external_id(new.req_id), "op": "save", "tokens": len(next(stored).slot_mapping)})
        return meta

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        STEP["load_s"] += time.perf_counter() - t

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        STEP["save_s"] += time.perf_counter() - t
