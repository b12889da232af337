"""vLLM's own CPU linear (oneDNN with prepacked weights), timed where a step runs it.

Why this probe exists: the ``torch_ops`` tables describe torch's ``F.linear`` (MKL), but vLLM on
the CPU prepacks every projection's weight once at load time and runs it through oneDNN
(``ops.onednn_mm``). The two differ most where decode batches live: at M = 4 MKL costs ~1.9x its
M = 1 time on this project's hosts, oneDNN ~1.06x. So predicting vLLM's steps needs vLLM's
kernel timed. Only the vLLM reference environment (``gpubench vllm setup``) has it: each
measurement is sent to one long-lived ``python -m vllmref.worker_ops`` child in that environment
(started on the first measurement, ended when the probe's worker ends).

Rows: ``family = "linear"``, ``engine = "vllm"``, the same dense M grid and (N, K) pairs as
``torch_ops``' linear family, the same cold-weight rule (every repetition calls a different
prepacked weight from a pool larger than 2x the last-level cache) and the same reference GEMV
beside every row (``ref_times_s``), so ``gpubench fit`` normalizes them the same way and writes
them into the calibration's ``cpu_ops`` tables as ``linear_vllm`` (used for vLLM's fused layout).
Times are the worker thread's CPU time (``vllm_ops.num_threads`` threads, default 1: the
reference engine's step rows are taken on one OpenMP thread); at more than one thread, the wall
time (``timer = "wall"``, ``vllmref.thread_clock`` says why).

``family = "attn_decode"`` / ``"attn_prefill"``, ``engine = "vllm"``: vLLM's CPU paged-attention
kernel (``ops.cpu_attention_with_kv_cache``, block size 128, split-KV, the ISA vLLM picks here),
over the head configurations and the (batch, context) and (new, cached) grids of ``torch_ops``'
attention families: B decode sequences of L keys in one call, or one prefill chunk of n new
tokens over c cached (causal, so n*c + n(n+1)/2 query-key pairs; vLLM skips the masked ones,
where torch's SDPA with a boolean mask computes all n(c+n)). The KV blocks are cold (a pool
larger than 2x the last-level cache, fresh blocks every repetition), the reference GEMV is timed
beside every row, and one problem per head configuration is checked against float64. ``gpubench
fit`` fits the same attention laws as for torch's rows into ``attn_vllm``, which the fused (vLLM)
layout uses in place of the SDPA laws.

``family = "engine_step"``: real vLLM engine steps of the shipped ``tiny-llama`` config (4 layers of
width 128, random weights) decoding B sequences, B = 1..32: the CPU time of a whole engine step
(schedule, input preparation, forward, sampling, output processing; all of the process's threads)
when the model's own ops cost next to nothing. ``gpubench fit`` keeps the per-B medians; the step
model subtracts what its tables price tiny-llama's ops at and charges the rest, vLLM's per-step
engine cost, to every vLLM step. One engine start per B (``vllmref.worker_profile``).

``family = "engine_layers"``: the same engine steps for synthetic Llamas of width 384 and 1024 at
2 and 10 layers (random weights, B = 1 and 8; quick: B = 1). ``gpubench fit`` keeps them as
``layers_vllm``. The time per added layer, less what the op tables price an added layer's
projections and attention at, is the rest of a vLLM layer: its own norm, RoPE and SiLU kernels,
its Python layer code, custom-op dispatch and attention metadata, with the caches cold after the
layer's weights. The step model charges that rest once per layer in place of the torch segment
tables' price at as many rows as sequences (those tables time torch's composite ops after an MKL
GEMM, which vLLM never runs).

Skipped, with the reason, on a host without the vLLM environment.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import subprocess
import zlib

from gpubench.backends.base import MeasurementSpec, Probe, ProbeConfig
from gpubench.backends.cpu.probes import torch_ops_grid as grid
from gpubench.backends.probe_common import cold_pool_bytes, dtypes_option, llc_bytes, opt

DTYPES = ("fp32", "bf16")
ATTENTION_BLOCK_SIZE = 128           # vLLM's CPU default, what the reference engine runs
ENGINE_MODEL = "tiny-llama"           # a shipped config whose ops cost a few % of a vLLM step
ENGINE_BATCH = (1, 2, 4, 8, 16, 32)
QUICK_ENGINE_BATCH = (1, 4, 16)
ENGINE_PROMPT_TOKENS = 64
ENGINE_DECODE_STEPS = 24              # per B: decode steps after the prefill; the first 2 are warm-up
# Synthetic Llama layers (random weights) at two depths per width: the step-time difference per
# layer, less what the op tables price a layer at, is vLLM's per-layer cost that no op probe sees
# (its Python layer code, custom-op dispatch and attention metadata, run with cold caches after a
# layer's weights streamed by). Widths bracket small models; wider ones take the widest's cost.
# Depths 2 and 10, not 2 and 6: one engine start's median step moves by ~10 % from start to start
# (three starts of the 6-layer width-1024 model at B = 1: 34.0, 34.8, 38.1 ms), and that noise,
# divided by the added layers, is the rest's; 8 added layers halve it against 4.
LAYER_WIDTHS = (384, 1024)
LAYER_DEPTHS = (2, 10)
LAYER_BATCH = (1, 8)
QUICK_LAYER_BATCH = (1,)
LAYER_HEAD_DIM = 64


class _VllmWorker:
    """The ``vllmref.worker_ops`` child: one JSON line out, one JSON line back."""

    def __init__(self):
        self.proc = None
        self.versions: dict = {}
        self._stack = contextlib.ExitStack()  # holds the worker's private PYTHONPATH directory

    def start(self, threads: int) -> None:
        from vllmref import env

        python = env.require_env()
        # a private PYTHONPATH with only vllmref (the main environment's packages must not leak in)
        path = self._stack.enter_context(env.vllmref_path())
        self.proc = subprocess.Popen([str(python), "-m", "vllmref.worker_ops"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                     env=env.worker_environ(threads=threads, pythonpath=path))
        hello = self._read()
        if "error" in hello:
            raise RuntimeError(hello["error"])
        self.versions = {"vllm_version": hello.get("vllm_version"), "torch_version": hello.get("torch_version")}
        atexit.register(self.stop)

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM ops worker exited (status {self.proc.poll()})")
        return json.loads(line)

    def request(self, req: dict, threads: int) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start(threads)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the worker ends its loop on EOF
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._stack.close()


_WORKER = _VllmWorker()


class VllmOpsProbe(Probe):
    name = "vllm_ops"
    description = ("vLLM's CPU linear (oneDNN, prepacked weights) and paged attention over torch_ops' grids, "
                   "cold weights and KV, plus real engine steps of a tiny model")
    timer = "thread_cpu"
    time_budget_s = 900.0
    # About 90 s on a 2-core host (starting vLLM alone takes a third of it): more than a quick run's minute.
    quick_leaves_out = "vLLM's own kernels and engine steps; the op tables then price torch's CPU kernels"

    def supported(self, backend) -> tuple[bool, str]:
        from vllmref import env

        if not env.is_ready():
            return False, f"the vLLM reference environment is not set up ({env.SETUP_HINT})"
        return True, ""

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        q = cfg.quick
        dtypes = dtypes_option(cfg, "vllm_ops", DTYPES)
        threads = opt(cfg, "vllm_ops", "num_threads", 1)
        scale = opt(cfg, "vllm_ops", "size_scale", 1.0)  # tests shrink every size
        max_m = opt(cfg, "vllm_ops", "max_m", 1 << 30)
        passes = opt(cfg, "vllm_ops", "linear_passes", grid.QUICK_LINEAR_PASSES if q else grid.LINEAR_PASSES)
        pool_bytes = cold_pool_bytes(llc_bytes(cfg.device))  # source weights + their packed copies fit
        if scale < 1:
            pool_bytes = int(pool_bytes * min(1.0, scale * 4))
        specs = []
        for dt in dtypes:
            for n, k, nn, kk, p, m in grid.linear_cells(q, scale, max_m, passes):
                specs.append(MeasurementSpec(
                    key=grid.linear_key("vllm_linear", dt, n, k, m, p),
                    params={"family": "linear", "engine": "vllm", "dtype": dt, "m": m, "n": nn, "k": kk,
                            "pass": p, "num_threads": threads, "pool_bytes": int(pool_bytes)},
                    label=f"vllm linear {dt} M={m} N={nn} K={kk} pass {p + 1}/{passes}"))
        if opt(cfg, "vllm_ops", "attention", True):
            specs += _attention_specs(cfg, dtypes, threads, int(pool_bytes), scale)
        if "fp32" in dtypes and opt(cfg, "vllm_ops", "engine_steps", True):
            max_b = opt(cfg, "vllm_ops", "max_batch", 1 << 30)
            for b in (QUICK_ENGINE_BATCH if q else ENGINE_BATCH):
                if b <= max_b:
                    specs.append(MeasurementSpec(
                        key=f"vllm_engine_step_{ENGINE_MODEL}_b{b}",
                        params={"family": "engine_step", "engine": "vllm", "dtype": "fp32", "model": ENGINE_MODEL,
                                "batch": b, "num_threads": threads},
                        label=f"vllm engine step {ENGINE_MODEL} B={b}"))
            if opt(cfg, "vllm_ops", "engine_layers", True):
                for w in LAYER_WIDTHS:
                    for depth in LAYER_DEPTHS:
                        for b in (QUICK_LAYER_BATCH if q else LAYER_BATCH):
                            if b <= max_b:
                                specs.append(MeasurementSpec(
                                    key=f"vllm_engine_layers_w{w}_l{depth}_b{b}",
                                    params={"family": "engine_layers", "engine": "vllm", "dtype": "fp32",
                                            "width": w, "layers": depth, "batch": b, "num_threads": threads},
                                    label=f"vllm engine step, {depth} layers of width {w}, B={b}"))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        if p["family"] == "engine_step":
            return _measure_engine_step(p)
        if p["family"] == "engine_layers":
            return _measure_engine_layers(p)
        if p["family"] in ("attn_decode", "attn_prefill"):
            return _measure_attention(p)
        req = {"m": p["m"], "n": p["n"], "k": p["k"], "dtype": p["dtype"], "pool_bytes": p["pool_bytes"],
               "threads": p["num_threads"], "seed": zlib.crc32(f"{p['n']}x{p['k']}".encode()), **_REPETITIONS}
        reply = _ask_worker(req, p)
        itemsize = 2 if p["dtype"] == "bf16" else 4
        m, n, k = p["m"], p["n"], p["k"]
        base = {key: v for key, v in p.items() if key != "pool_bytes"}
        return {**base, **_WORKER.versions, **reply, "flops": grid.linear_flops(m, n, k),
                "bytes": grid.linear_bytes(m, n, k, itemsize), "weight_bytes": n * k * itemsize}


# how every worker measurement repeats, and the reference GEMV timed beside it (torch_ops' rules)
_REPETITIONS = {"min_reps": grid.MIN_REPS, "max_reps": grid.MAX_REPS, "min_timed_s": grid.MIN_TIMED_S,
                "ref_n": grid.REFERENCE_SHAPE[0], "ref_k": grid.REFERENCE_SHAPE[1], "ref_reps": grid.REFERENCE_REPS}


def _ask_worker(req: dict, p: dict) -> dict:
    reply = _WORKER.request(req, int(p["num_threads"]))
    if "error" in reply:
        raise RuntimeError(f"vLLM ops worker: {reply['error']}")
    return reply


def _attention_specs(cfg: ProbeConfig, dtypes, threads: int, pool_bytes: int, scale: float) -> list[MeasurementSpec]:
    """The attention families over torch_ops' head configurations and grids (sizes scaled in tests)."""
    q = cfg.quick
    max_b = opt(cfg, "vllm_ops", "max_batch", 1 << 30)

    def sz(v: int, floor: int = 1) -> int:
        return max(floor, int(v * scale))

    common = {"engine": "vllm", "num_threads": threads, "pool_bytes": pool_bytes, "block_size": ATTENTION_BLOCK_SIZE}
    specs = []
    for dt in dtypes:
        for h, hkv, d in (grid.QUICK_ATTN_HEADS if q else grid.ATTN_HEADS):
            for b in (grid.QUICK_DECODE_BATCH if q else grid.DECODE_BATCH):
                for ctx in (grid.QUICK_DECODE_CONTEXT if q else grid.DECODE_CONTEXT):
                    if b > max_b or b * ctx > grid.MAX_DECODE_KV_TOKENS:
                        continue
                    specs.append(MeasurementSpec(
                        key=f"vllm_attn_decode_{dt}_h{h}_kv{hkv}_d{d}_b{b}_l{ctx}",
                        params={**common, "family": "attn_decode", "dtype": dt, "heads": h, "kv_heads": hkv,
                                "head_dim": d, "batch": b, "context": sz(ctx, 4)},
                        label=f"vllm attn decode {dt} H={h}/{hkv} B={b} L={ctx}"))
            for n_new in (grid.QUICK_PREFILL_NEW if q else grid.PREFILL_NEW):
                for cached in (grid.QUICK_PREFILL_CACHED if q else grid.PREFILL_CACHED):
                    specs.append(MeasurementSpec(
                        key=f"vllm_attn_prefill_{dt}_h{h}_kv{hkv}_d{d}_n{n_new}_c{cached}",
                        params={**common, "family": "attn_prefill", "dtype": dt, "heads": h, "kv_heads": hkv,
                                "head_dim": d, "new_tokens": sz(n_new, 2), "cached_tokens": sz(cached, 0) if cached else 0},
                        label=f"vllm attn prefill {dt} H={h}/{hkv} n={n_new} c={cached}"))
    return specs


def _measure_attention(p: dict) -> dict:
    """One call of vLLM's CPU attention kernel on a decode group or one prefill chunk (cold KV)."""
    if p["family"] == "attn_decode":
        b, ctx = int(p["batch"]), int(p["context"])
        # a decode's query is its sequence's last token: L cached keys plus its own
        seq_lens, query_lens = [ctx + 1] * b, [1] * b
        kv_tokens, query_tokens = b * (ctx + 1), b
        pairs = kv_tokens
    else:
        n, c = int(p["new_tokens"]), int(p["cached_tokens"])
        seq_lens, query_lens = [c + n], [n]
        kv_tokens, query_tokens = c + n, n
        pairs = n * c + n * (n + 1) // 2
    h, hkv, d = int(p["heads"]), int(p["kv_heads"]), int(p["head_dim"])
    req = {"op": "attention", "heads": h, "kv_heads": hkv, "head_dim": d, "block_size": p["block_size"],
           "seq_lens": seq_lens, "query_lens": query_lens, "dtype": p["dtype"], "pool_bytes": p["pool_bytes"],
           "threads": p["num_threads"], "seed": zlib.crc32(f"{h}x{hkv}x{d}".encode()), **_REPETITIONS}
    reply = _ask_worker(req, p)
    itemsize = 2 if p["dtype"] == "bf16" else 4
    base = {key: v for key, v in p.items() if key != "pool_bytes"}
    # FLOPs: QK^T and PV, 2 x 2 x d per visible (query, key) pair and head; bytes: K and V read
    # once per KV head, Q read and the output written once.
    return {**base, **_WORKER.versions, **reply, "flops": 4 * pairs * h * d,
            "bytes": (2 * kv_tokens * hkv * d + 2 * query_tokens * h * d) * itemsize}


def layer_probe_config(width: int, layers: int) -> dict:
    """The Hugging Face config of the synthetic Llama the ``engine_layers`` rows run: ``layers``
    layers of ``width`` (head_dim 64, one KV head per four query heads, MLP 8/3 x width rounded to
    64, a 1,024-token vocabulary so the LM head costs next to nothing)."""
    heads = max(1, width // LAYER_HEAD_DIM)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": width,
            "intermediate_size": 64 * round(8 * width / 3 / 64), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": LAYER_HEAD_DIM,
            "vocab_size": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0, "rope_scaling": None,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "float32"}


def _measure_engine_layers(p: dict) -> dict:
    """``_measure_engine_step`` on the synthetic Llama of ``p``'s width and depth (its config kept in
    the row, so the fit can price the same model's ops)."""
    from common.outdir import write_text_atomic
    from vllmref import env

    config = layer_probe_config(int(p["width"]), int(p["layers"]))
    path = env.models_dir() / "layer-probes" / f"layers-w{p['width']}-l{p['layers']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(config, indent=1))
    return {**_measure_engine_step({**p, "model": str(path)}), "model": path.stem, "config": config}


def _measure_engine_step(p: dict) -> dict:
    """CPU seconds of real vLLM engine steps decoding ``batch`` sequences of the tiny model."""
    from vllmref import env

    model_dir, real_weights, _ = env.resolve_model(p["model"])
    b = int(p["batch"])
    scenario = {"name": f"decode-b{b}", "requests": [
        {"name": f"r{i}", "prompt": [["unique", ENGINE_PROMPT_TOKENS]], "max_tokens": ENGINE_DECODE_STEPS + 1,
         "after_step": 0} for i in range(b)]}
    spec = {"vocab_size": 1024, "scenarios": [scenario],
            "engine": {"model": str(model_dir), "real_weights": real_weights, "block_size": 128,
                       "max_num_batched_tokens": 4096, "max_num_seqs": 256, "max_model_len": 1024,
                       "enable_prefix_caching": True, "seed": 0}}
    records = env.run_worker("worker_profile", spec, threads=int(p["num_threads"]), kv_cache_gib=1)
    steps = [r for r in records if r.get("kind") == "step"]
    decode = [r for r in steps if len(r["batch"]) == b and all(x["decode"] for x in r["batch"])]
    times = [float(r["process_cpu_s"]) for r in decode]
    facts = next((r for r in records if r.get("kind") == "engine"), {})
    context = [int(x["num_computed_before"]) for r in decode for x in r["batch"]]
    out = {**{k: v for k, v in p.items()}, "times_s": times, "valid": len(times) >= 5,
           "num_steps": len(steps), "context_mean": float(sum(context) / len(context)) if context else 0.0,
           "vllm_version": facts.get("vllm_version"), "torch_version": facts.get("torch_version"),
           "wall_times_s": [float(r["t_end"] - r["t_start"]) for r in decode if "t_end" in r]}
    if not out["valid"]:
        out["invalid_reason"] = f"only {len(times)} decode steps of batch {b} recorded"
    return out
