"""One CPU engine step priced op by op from the calibration's ``cpu_ops`` tables (predictor.cpu_tables).

``CpuTableStep(tables, model, layout)`` precomputes, for the model's shapes, one curve per
projection over M and one per segment over T, so pricing a batch is a dozen 1-D interpolations in
plain Python (the scheduler's hot path). The op names are the step graph's (predictor.ops), so a
breakdown reads like the roofline model's. Qwen3's ``qk_norm`` is priced as two RMSNorm segments
(q's and k's widths). Mixture-of-experts models are refused (ConfigError): the tables have no
routed-expert shapes; ``form="max"`` (the roofline) or a calibration without ``cpu_ops`` prices them.
"""
from __future__ import annotations

from common.errors import ConfigError
from common.model_config import ModelConfig
from predictor.cpu_tables import LAYOUTS, CpuOpTables, config_coef, prefill_pairs

SEGMENT_T_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class CpuTableStep:
    """Step times of ``model`` from ``tables``; ``layout``: "separate" or "fused" projections.

    ``padded_decode``: the decode group is one attention call padded to its longest sequence (this
    project's torch engine: one SDPA with a key mask), so it reads B x max(L) keys; otherwise each
    sequence's own L_i (vLLM's paged attention).
    """

    def __init__(self, tables: CpuOpTables, model: ModelConfig, layout: str = "separate",
                 padded_decode: bool = False, engine_cost: bool = True, layer_rest: bool = True):
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown GEMM layout '{layout}' (choose from: {', '.join(LAYOUTS)})")
        if model.is_moe:
            raise ConfigError(f"{model.name} is a mixture-of-experts model, which the CPU op tables do not price; "
                              "use --form max (the roofline) or a calibration without cpu_ops")
        self.tables, self.model, self.layout, self.padded_decode = tables, model, layout, padded_decode
        cfg = model
        h, q, kv, ff, vocab = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.vocab_size
        # the fused layout is vLLM's: its projections are oneDNN calls on prepacked weights, priced
        # from the vllm_ops rows when the calibration has them (torch's F.linear otherwise)
        self.linear_engine = "vllm" if layout == "fused" and tables.linear_vllm is not None else "torch"
        ms = tables.linear_vllm_m if self.linear_engine == "vllm" else tables.linear_m

        def lin(n, k):
            return tables.linear_curve(n, k, ms, self.linear_engine)

        if layout == "separate":
            self.projections = {"qkv_proj": [lin(q, h), lin(kv, h), lin(kv, h)], "o_proj": [lin(h, q)],
                                "gate_up": [lin(ff, h), lin(ff, h)], "down": [lin(h, ff)]}
        else:
            self.projections = {"qkv_proj": [lin(q + 2 * kv, h)], "o_proj": [lin(h, q)],
                                "gate_up": [lin(2 * ff, h)], "down": [lin(h, ff)]}
        self.lm_head = lin(vocab, h)

        def seg(name, width, context_bytes):
            return tables.segment_curve(name, width, list(SEGMENT_T_GRID), context_bytes)

        # What the op before each segment streamed (bytes), in the engine's order: a layer starts
        # after the previous layer's down projection; rope follows v (or the fused qkv); the second
        # rope, the KV write and the post-attention norm follow other small ops (caches warm).
        item = tables.itemsize
        down_b, o_b, vocab_b = h * ff * item, h * q * item, vocab * h * item
        v_b = (kv if layout == "separate" else q + 2 * kv) * h * item
        up_b = (ff if layout == "separate" else 2 * ff) * h * item
        self.norm_in, self.norm_post, self.norm_final = seg("rmsnorm", h, down_b), seg("rmsnorm", h, 0), seg("rmsnorm", h, down_b)
        self.residual_attn, self.residual_mlp = seg("residual_add", h, o_b), seg("residual_add", h, down_b)
        self.silu_mul, self.kv_write = seg("silu_mul", ff, up_b), seg("kv_write", kv, 0)
        self.rope_q, self.rope_kv = seg("rope", q, v_b), seg("rope", kv, 0)
        self.embed, self.argmax = seg("embed", h, None), seg("argmax", vocab, vocab_b)
        # Qwen3: q_norm and k_norm, one RMSNorm call each over T rows of q's and k's width
        self.qk_norms = (seg("rmsnorm", q, 0), seg("rmsnorm", kv, 0)) if cfg.qk_norm else ()
        self.num_layers = cfg.num_layers
        # vLLM's layout: its per-step engine cost (``engine_cost``) and its measured rest of a layer
        # in place of the torch segment tables (``layer_rest``), where the probe run has them
        vllm_engine = self.linear_engine == "vllm"
        self.engine = self._engine_curve(tables) if engine_cost and vllm_engine else None
        self.layer_rest = self._layer_rest_curve(tables, cfg.hidden_size) if layer_rest and vllm_engine else None
        hd = cfg.head_dim
        heads = (cfg.num_heads, cfg.num_kv_heads, hd)
        # vLLM's layout runs vLLM's paged-attention kernel (the vllm_ops attention rows, ``attn_vllm``)
        # when the calibration has them: a prefill chunk is causal over its cache (the masked pairs
        # skipped), where torch's SDPA computes every pair under a boolean mask
        vllm_attention = tables.d.get("attn_vllm") if self.linear_engine == "vllm" else None
        self.attention_engine = "vllm" if vllm_attention else "torch"
        decode_law = vllm_attention["decode"] if vllm_attention else tables.d["attn_decode"]
        prefill_laws = {"causal": vllm_attention["prefill"]} if vllm_attention else tables.d["attn_prefill"]
        self._masked_prefill = not vllm_attention
        dc = config_coef(decode_law, *heads)
        self._dec = (dc["a"], dc["b"], dc["c_q"] * cfg.num_heads * hd + dc["e_kv"] * cfg.num_kv_heads * hd)
        self._pre = {}
        for mode, law in prefill_laws.items():
            pc = config_coef(law, *heads)
            self._pre[mode] = (pc["a"], pc["b_new"] * cfg.num_heads * hd, pc["e_kv"] * cfg.num_kv_heads * hd,
                               pc["p_pairs"] * cfg.num_heads * hd)

    def _engine_curve(self, tables: CpuOpTables):
        """vLLM's per-step engine cost by number of sequences: the probe's tiny-model engine steps
        minus what these tables price that model's own layers and ops at (None without engine_step
        rows)."""
        from common.model_config import load_model_config
        from predictor.cpu_tables import Curve1D

        eng = tables.d.get("engine_vllm")
        if not eng:
            return None
        # tiny's layers priced as this model's are, with vLLM's measured rest of a layer (else a
        # batch's overpriced torch segments would hide the engine's cost)
        tiny = CpuTableStep(tables, load_model_config(eng["model"]), "fused", engine_cost=False)
        residual = [max(0.0, s - tiny.predict_time([(1, int(c))] * int(b)))
                    for b, s, c in zip(eng["num_seqs"], eng["s"], eng["context_mean"])]
        return Curve1D(tuple(int(b) for b in eng["num_seqs"]), tuple(residual))

    def _layer_rest_curve(self, tables: CpuOpTables, width: int):
        """What a vLLM layer costs besides its projections and attention, per layer, by number of
        sequences, at this model's width (None without engine_layers rows).

        At each probed width: the measured step time per added layer of the synthetic models, less
        what these tables price an added layer's projections and attention at (clipped at zero).
        That rest is vLLM's own: its norm, RoPE and SiLU kernels, its Python layer code, custom-op
        dispatch and attention metadata, with the caches cold after the layer's weights. The torch
        segment tables do not describe it: they time torch's composite ops after an MKL GEMM, and
        on some hosts a small op after an MKL GEMM of two or more rows costs ~200 us where vLLM's
        decode steps stay flat in the batch. Interpolated in log width, clamped to the probed widths.
        """
        from common.model_config import from_dict
        from predictor.cpu_tables import Curve1D, _bracket

        nodes = (tables.d.get("layers_vllm") or {}).get("nodes") or []
        if not nodes:
            return None
        curves = {}
        for node in nodes:
            (shallow, deep), added = node["depths"][:2], node["depths"][1] - node["depths"][0]
            lo, hi = (CpuTableStep(tables, from_dict(node["configs"][i], name=f"layers-w{node['width']}-l{d}"),
                                   "fused", engine_cost=False, layer_rest=False) for i, d in enumerate((shallow, deep)))
            rest = []
            for j, b in enumerate(node["num_seqs"]):
                measured = node["s"][1][j] - node["s"][0][j]
                batch_lo = [(1, int(node["context_mean"][0][j]))] * b
                batch_hi = [(1, int(node["context_mean"][1][j]))] * b
                # an added layer's projections and attention: the priced difference less its segments
                priced = hi.predict_time(batch_hi) - lo.predict_time(batch_lo) - added * hi.segments_s(b)
                rest.append(max(0.0, measured - priced) / added)
            curves[node["width"]] = Curve1D(tuple(node["num_seqs"]), tuple(rest))
        widths = sorted(curves)
        i, j, w = _bracket(widths, width)
        a, b = curves[widths[i]], curves[widths[j]]
        xs = sorted(set(a.x) | set(b.x))
        return Curve1D(tuple(xs), tuple((1 - w) * a.at(x, proportional_past_end=False)
                                        + w * b.at(x, proportional_past_end=False) for x in xs))

    def segments_s(self, num_new: int) -> float:
        """One layer's segments (norms, RoPE, KV write, residual adds, SiLU) at ``num_new`` rows,
        as the torch segment tables price them."""
        t = (self.norm_in.at(num_new) + self.norm_post.at(num_new) + self.rope_q.at(num_new)
             + self.rope_kv.at(num_new) + self.kv_write.at(num_new) + self.residual_attn.at(num_new)
             + self.residual_mlp.at(num_new) + self.silu_mul.at(num_new))
        for c in self.qk_norms:
            t += c.at(num_new)
        return t

    def layer_extra_s(self, num_new: int, num_seqs: int, segments_new: float | None = None) -> float:
        """Per layer, what vLLM's measured rest of a layer adds to (or, negative, takes from) the
        torch-priced segments at ``num_new`` rows: the rest at ``num_seqs`` sequences replaces the
        segments' price at as many rows (a decode step: all of it), and rows past them (a prefill
        chunk's) keep the tables' growth. 0 without engine_layers rows (and for the torch engine).
        ``segments_new``: ``segments_s(num_new)`` when the caller has it."""
        if self.layer_rest is None:
            return 0.0
        rest = self.layer_rest.at(num_seqs, proportional_past_end=False)
        seg_new = self.segments_s(num_new) if segments_new is None else segments_new
        seg_seqs = seg_new if num_seqs == num_new else self.segments_s(num_seqs)
        return max(rest - seg_seqs, -seg_new)

    def engine_s(self, num_seqs: int) -> float:
        """vLLM's per-step engine cost for ``num_seqs`` sequences (0 for the torch engine)."""
        return 0.0 if self.engine is None else self.engine.at(num_seqs)

    def attention_s(self, batch) -> float:
        """One layer's attention: the decode group (one call) plus one call per prefill sequence.

        Decodes are sequences with one new token and a cache (as the engine groups them); the
        group's call reads every decode sequence's keys.
        """
        a, b, per_key = self._dec
        num_decode = 0
        decode_keys = 0
        longest = 0
        t = 0.0
        for n, c in batch:
            if n == 1 and c > 0:
                num_decode += 1
                decode_keys += c + 1
                if c + 1 > longest:
                    longest = c + 1
            else:
                masked = self._masked_prefill and c > 0
                pa, pb, pe, pp = self._pre["masked" if masked else "causal"]
                t += pa + pb * n + pe * (c + n) + pp * prefill_pairs(n, c, masked)
        if num_decode:
            keys = num_decode * longest if self.padded_decode else decode_keys
            t += a + b * num_decode + per_key * keys
        return t

    def op_times(self, batch) -> dict:
        """Seconds per step-graph op (summed over layers) for ``batch`` [(num_new, num_cached), ...].

        With vLLM's measured rest of a layer (``layer_extra_s``): a rest above the torch-priced
        segments is charged as engine cost (work no op table sees); one below scales the segment
        ops down to it."""
        num_new = sum(n for n, _ in batch)
        num_seqs = len(batch)
        layers = self.num_layers
        seg = self.segments_s(num_new)
        extra = self.layer_extra_s(num_new, num_seqs, seg)
        scale = (seg + extra) / seg if extra < 0 and seg > 0 else 1.0
        per_layer = layers * scale
        qk = {"qk_norm": per_layer * sum(c.at(num_new) for c in self.qk_norms)} if self.qk_norms else {}
        return {
            "embed": self.embed.at(num_new),
            "input_norm": per_layer * self.norm_in.at(num_new),
            "qkv_proj": layers * sum(c.at(num_new) for c in self.projections["qkv_proj"]),
            **qk,
            "rope": per_layer * (self.rope_q.at(num_new) + self.rope_kv.at(num_new)),
            "attention": per_layer * self.kv_write.at(num_new) + layers * self.attention_s(batch),
            "o_proj": layers * self.projections["o_proj"][0].at(num_new),
            "residual": per_layer * self.residual_attn.at(num_new),
            "post_norm": per_layer * self.norm_post.at(num_new),
            "gate_up": layers * sum(c.at(num_new) for c in self.projections["gate_up"]),
            "act_mul": per_layer * self.silu_mul.at(num_new),
            "down": layers * self.projections["down"][0].at(num_new),
            "residual2": per_layer * self.residual_mlp.at(num_new),
            "final_norm": self.norm_final.at(num_seqs),
            "lm_head": self.lm_head.at(num_seqs),
            "sample": self.argmax.at(num_seqs),
            "engine": self.engine_s(num_seqs) + layers * max(0.0, extra),
        }

    def predict_time(self, batch) -> float:
        """Seconds of one step (the sum of :meth:`op_times`), plain Python."""
        num_new = 0
        for n, _ in batch:
            num_new += n
        num_seqs = len(batch)
        seg = self.segments_s(num_new)
        per_layer = seg + self.attention_s(batch)
        if self.layer_rest is not None:
            per_layer += self.layer_extra_s(num_new, num_seqs, seg)
        for curves in self.projections.values():
            for c in curves:
                per_layer += c.at(num_new)
        return (self.num_layers * per_layer + self.embed.at(num_new) + self.norm_final.at(num_seqs)
                + self.lm_head.at(num_seqs) + self.argmax.at(num_seqs) + self.engine_s(num_seqs))
