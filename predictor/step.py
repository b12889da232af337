"""StepModel: the time of one forward step from the op graph, the hardware and a calibration.

Per op (docs/predictor.md), with spec peak P of the op's unit and bandwidth B::

    t_c = FLOPs / (P * eta_c)          eta_c = f_clk * eta_cluster(M,N,K) * eta_active * eta_duty(M)
    t_m = bytes / (B * eta_mem(x))     x = bytes / L2;  equivalently (bytes + x_half*L2) / (B*eta_max)

Step (``form="additive"``)::

    GPU:  t = sum_op max(t_c, t_m) + N_kern * t_interval + S(N) + t_samp
    CPU:  t = sum_op max(t_c, t_m) + N_dispatch * t_dispatch + S(N) + t_samp   (no async queue)

On a GPU every kernel pays the device-side interval between dependent kernels: the eager
back-to-back launch interval, or with ``cuda_graphs=True`` the (shorter) graph-node interval; and
t_m there is bytes / (B * eta_max) with no x_half term (see ``_setup_constants``). GPU attention is
priced per part and per sequence (predictor.gpu_attention): a mixed batch's decodes and prefill
chunks each get their own max(t_c, t_m), and a decode batch whose longest sequence cannot spread
over the SMs (split-KV decoding gives every sequence the same number of splits) is bound by that
sequence.

``form="max"`` is the monolithic baseline: ``sum_op max`` becomes ``max(sum t_c, sum t_m)`` and the
launch term a floor, ``max(blocks, N_kern * t_interval)``; the other terms (T_0) are the same, so
additive >= max on the same op list. eta_duty(M) is the
calibration's measured per-M curve (``curves.eta_duty_by_m``) for GEMM ops when it has one for the
dtype, else the scalar eta_duty (which attention ops always use); it and the GEMMs' monotone time
envelope are predictor.gemm_timing. S(N) = s_floor + s_slope * max(0, N - 1) with N the number of
sequences. ``predict_time(batch, async_scheduling=True)`` overlaps S(N) with the device work (vLLM
V1's asynchronous scheduling). ``predict(batch)`` also returns the per-op breakdown
(predictor.step_prediction).

On the CPU, a calibration with ``cpu_ops`` tables for the dtype (from the ``torch_ops`` probe)
replaces the additive form: each op is priced from what the probe measured torch doing with that
shape in a step's cold context (predictor.cpu_step); ``gemm_layout`` says whether the engine
issues q/k/v and gate/up as separate calls ("separate", transformers and the torch engine) or
fused ("fused", vLLM). ``form="max"`` stays the roofline baseline.

Variants are types: ``StepModel(...)`` builds the one its hardware and calibration call for, each a
``StepModel`` with the same interface (``predict_time``, ``predict_features``, ``predict_many``,
``predict``, ``predict_interval``): :class:`predictor.step_variants.GpuRooflineStep`,
:class:`predictor.step_variants.CpuRooflineStep` and :class:`predictor.step_variants.CpuOpTableStep`.
This module holds what they share (the op graph, the calibrated rates and the roofline paths).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from common.errors import ConfigError
from common.model_config import ModelConfig, load_model_config
from predictor import efficiency as eff
from predictor.calibrate import Calibration, resolve
from predictor.gemm_timing import GEMM_ENVELOPE_SEGMENTS, GemmTiming
from predictor.gpu_attention import AttentionOverheads, GpuAttention
from predictor.hardware import DTYPE_BYTES, HardwareSpec
from predictor.ops import OpGraph, batch_features, batch_sums, decode_features
from predictor.step_prediction import StepPrediction, roofline_prediction

if TYPE_CHECKING:
    from predictor.cpu_step import CpuTableStep

FORMS = ("additive", "max")


class StepModel:
    """Predicts forward-step times of ``model`` on ``hardware``.

    ``StepModel(...)`` returns the variant for the hardware and calibration (module docstring):
    GPU roofline on a GPU, the CPU op tables on the CPU when the calibration has them for the dtype
    and ``form`` is additive, else the CPU roofline.

    Args:
        hardware: a HardwareSpec or an SKU id (``"h100"``, ``"cpu"``).
        model: a ModelConfig, a shipped model name, or a path to a config.json.
        calibration: None (published, then spec defaults), a calibration.json path, a dict, or a
            Calibration; it must be for the same SKU.
        form: "additive" (sum of per-op max) or "max" (max of sums, the monolithic baseline).
        cuda_graphs: charge each kernel the graph-node interval instead of the eager launch
            interval (GPU only).
        dtype: weights/activations/KV dtype; None means bf16 on GPUs and fp32 on the CPU.
        gemm_layout: "separate" or "fused" projections (CPU op tables only, see the module docstring).
    """

    # What a variant is (set by each, predictor.step_variants): its registry name, whether it prices
    # a GPU (kernels, device intervals, an asynchronous queue the host can overlap) or the CPU.
    variant: ClassVar[str] = ""
    gpu: ClassVar[bool] = False
    _VARIANTS: ClassVar[dict[str, type["StepModel"]]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.variant:
            StepModel._VARIANTS[cls.variant] = cls

    def __new__(cls, hardware, model, *, calibration=None, form: str = "additive", cuda_graphs: bool = False,
                dtype: str | None = None, gemm_layout: str = "separate") -> "StepModel":
        if form not in FORMS:
            raise ConfigError(f"unknown form '{form}' (choose from: {', '.join(FORMS)})")
        hw = HardwareSpec.from_sku(hardware) if isinstance(hardware, str) else hardware
        dtype = dtype or hw.default_dtype
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype '{dtype}' (choose from: {', '.join(DTYPE_BYTES)})")
        cal = resolve(calibration, hw, dtype)
        name = cls.variant or _variant_name(hw, cal, form, dtype)
        self = object.__new__(StepModel._VARIANTS[name])
        self._setup(hw, model, cal, form=form, cuda_graphs=cuda_graphs, dtype=dtype, gemm_layout=gemm_layout)
        return self

    def __init__(self, *args, **kwargs) -> None:
        """Set up by ``__new__``: which variant to build depends on the resolved calibration."""

    def _setup(self, hw: HardwareSpec, model, cal: Calibration, *, form: str, cuda_graphs: bool, dtype: str,
               gemm_layout: str) -> None:
        self.model: ModelConfig = load_model_config(model) if not isinstance(model, ModelConfig) else model
        self.dtype = dtype
        self.calibration: Calibration = cal
        overrides = {k: p.value for k, p in cal.hardware.items()}
        if hw.backend == "cpu":
            # NOTE(predictor): the host's core count is read at run time already, and a spec limited
            # with HardwareSpec.with_cores(n) must keep its n (its peaks were scaled to it).
            overrides.pop("num_sms", None)
        if "num_sms" in overrides:
            overrides["num_sms"] = int(overrides["num_sms"])
        if "mem_bytes_per_s" in overrides:
            overrides["mem_bw_tier"] = cal.hardware["mem_bytes_per_s"].tier
        self.hardware: HardwareSpec = hw.replace(**overrides) if overrides else hw
        self.form = form
        self.cuda_graphs = bool(cuda_graphs)
        self.gemm_layout = gemm_layout
        self.graph = OpGraph(self.model, DTYPE_BYTES[self.dtype])
        self.cpu_table: CpuTableStep | None = None  # the CPU op-table variant's tables
        self._setup_constants()

    @classmethod
    def for_names(cls, sku: str = "h100-sxm", model: str = "llama-3.1-8b", calibration=None, **kw) -> "StepModel":
        """StepModel from an SKU id and a model name or config path (keywords as the constructor)."""
        return cls(HardwareSpec.from_sku(sku), model, calibration=calibration, **kw)

    # ---------------------------------------------------------------- setup
    def _setup_constants(self) -> None:
        """Everything that does not depend on the batch, precomputed once (the hot path is numpy)."""
        hw, cal, g = self.hardware, self.calibration, self.graph
        v = cal.value
        self.f_clk = v("f_clk")
        self.eta_active = v("eta_active")
        self.eta_duty = v("eta_duty")
        self.eta_max = v("eta_max")
        self.x_half = v("x_half")
        self.tile, self.wave = eff.tile_shape(hw.arch), cal.value_or("wave_quantization", 1.0)
        self.duty_curve = cal.curve("eta_duty_by_m", self.dtype)
        tensor_peak = hw.peak(self.dtype)
        vector_peak = hw.peak_flops_per_s.get("vector", tensor_peak)
        matrix = np.isin(g.kinds, ("gemm", "attention"))
        # eta_c without eta_cluster (that one depends on M); elementwise ops run on vector units.
        eta_c = np.where(matrix, self.f_clk * self.eta_active * self.eta_duty, self.f_clk * self.eta_active)
        self._flops_per_s = np.where(matrix, tensor_peak, vector_peak) * eta_c
        # t_m = bytes * (x + x_half) / (B * eta_max * x) = (bytes + x_half * L2) / (B * eta_max)
        self._mem_bytes_per_s = hw.mem_bytes_per_s * self.eta_max
        self._mem_latency_bytes, self.t_gemm_fixed_s = self._memory_latency_and_gemm_fixed()
        self.attn_overheads, eta_attn = self._attention_overheads_and_share()
        attn = g.names.index("attention")
        self._flops_per_s[attn] *= eta_attn
        self._op_fixed_s = np.where(g.kinds == "gemm", self.t_gemm_fixed_s * g.num_kernels, 0.0)
        self._op_fixed_s[attn] = self.attn_overheads.fixed_s
        self.num_kernels, self.t_launch_s = self._launches()
        self.launch_s = self.num_kernels * self.t_launch_s
        self.s_floor_s = v("s_floor_ms") * 1e-3
        self.s_slope_s = v("s_slope_ms") * 1e-3
        self._block_mask = np.ones(g.num_ops, dtype=bool)
        self._block_mask[g.sample_index] = False
        self._gemm = GemmTiming(g, hw.num_sms, self.tile, self._flops_per_s, self.duty_curve, self.eta_duty, self.wave)
        self._duty_ratio_scalar = self._gemm.duty_ratio_scalar  # bound once: predict_time calls it per GEMM op
        self._attention = GpuAttention(g, hw.num_sms, self.model.num_kv_heads, self._flops_per_s, self._mem_bytes_per_s,
                                       overheads=self.attn_overheads)
        self._attn_index = self._attention.index
        self._gpu_attention = self._attention.price  # bound once: predict_time calls it per step
        self._setup_scalar_path()

    def _memory_latency_and_gemm_fixed(self) -> tuple[float, float]:
        """(bytes of the memory law's fixed term, a GEMM kernel's fixed seconds): the variant's."""
        raise NotImplementedError

    def _attention_overheads_and_share(self) -> tuple[AttentionOverheads, float]:
        """(an attention kernel's overheads, attention's compute rate as a share of the matrix units'
        rate): none and 1 unless a GPU variant's calibration measured them."""
        return AttentionOverheads(), 1.0

    def _launches(self) -> tuple[int, float]:
        """(kernels or dispatches a step issues, seconds each): the variant's."""
        raise NotImplementedError

    def _decode_attention_bound(self, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray) -> None:
        """Raise attention's times in place where one sequence binds or sequences cost (GPU only)."""

    def _attention_parts(self, f, decode, longest_decode) -> tuple[float, float, float] | None:
        """(t_c, t_m, t) of the attention op priced per sequence part, or None (priced by features)."""
        return None

    def _setup_scalar_path(self) -> None:
        """Plain-Python tuples for ``predict_time``: one batch costs ~15 ops x 5 features of float
        arithmetic, cheaper than a dozen small numpy calls."""
        g = self.graph
        gemm = {int(i): (int(g.gemm_m_feature[j]), float(g.gemm_n[j]), float(g.gemm_k[j]))
                for j, i in enumerate(g.gemm_index)}
        self._scalar_ops = [
            (tuple(g.flops[i]), tuple(g.bytes[i]), float(self._flops_per_s[i]), float(g.num_calls[i]),
             gemm.get(i), i == g.sample_index, float(self._op_fixed_s[i]))
            for i in range(g.num_ops)
        ]
        self._scalar_env = {int(i): self._gemm.env_list[j] for j, i in enumerate(g.gemm_index)}
        # MoE: op index -> the saturated (every expert) weight bytes the coefficients hold
        self._expert_bytes = {int(i): float(b) for i, b in zip(g.expert_index, g.expert_weight_bytes)}

    # ---------------------------------------------------------------- core (vectorized)
    def _op_times(self, feats: np.ndarray):
        """(t_c, t_m) per call, each (P, num_ops), for (P, 5) features."""
        g = self.graph
        flops = feats @ g.flops.T
        nbytes = g.per_call(feats, "bytes")  # MoE: the expected distinct experts' weights
        cluster = np.ones_like(flops)
        if g.gemm_index.size:
            m = feats[:, g.gemm_m_feature]
            cluster[:, g.gemm_index] = (eff.eta_cluster(m, g.gemm_n, g.gemm_k, self.hardware.num_sms, self.tile, self.wave)
                                        * self._gemm.duty_ratio(m))
        t_c = flops / (self._flops_per_s * cluster)
        if g.gemm_index.size:
            env = self._gemm.env[np.arange(g.gemm_index.size), self._gemm.segment(m)]
            t_c[:, g.gemm_index] = np.minimum(t_c[:, g.gemm_index], env)
        t_m = np.where(nbytes > 0, (nbytes + self._mem_latency_bytes) / self._mem_bytes_per_s, 0.0)
        self._decode_attention_bound(feats, t_c, t_m)
        return t_c, t_m

    def _combine(self, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray, op_t: np.ndarray | None = None):
        """Step totals (P,) and their parts from per-call op times (``op_t``: each op's time per
        call in the additive form when it is not max(t_c, t_m), as for GPU attention)."""
        calls = self.graph.num_calls
        mask = self._block_mask
        compute_s = t_c[:, mask] @ calls[mask]
        memory_s = t_m[:, mask] @ calls[mask]
        op_t = np.maximum(t_c, t_m) + self._op_fixed_s if op_t is None else op_t
        if self.form == "additive":
            blocks_s = op_t[:, mask] @ calls[mask]
        else:
            blocks_s = np.maximum(compute_s, memory_s)
        s = self.graph.sample_index
        sample_s = op_t[:, s]
        if not self._launch_is_floor():
            # CPU: each dispatch is paid before its op runs; GPU: each kernel pays the interval
            launch_added_s = np.full_like(blocks_s, self.launch_s)
        else:
            launch_added_s = np.maximum(0.0, self.launch_s - blocks_s)
        num_seqs = feats[:, 2]
        host_s = self.s_floor_s + self.s_slope_s * np.maximum(0.0, num_seqs - 1)
        if not self._launch_is_floor():
            total_s = blocks_s + launch_added_s + host_s + sample_s
        else:  # max(blocks, floor), not blocks + (floor - blocks): that sum is off by an ulp
            total_s = np.maximum(blocks_s, self.launch_s) + host_s + sample_s
        return total_s, dict(blocks_s=blocks_s, compute_s=compute_s, memory_s=memory_s,
                             launch_added_s=launch_added_s, host_s=host_s, sample_s=sample_s)

    def _launch_is_floor(self) -> bool:
        """True when launches are a floor under the blocks (the GPU's max form), not a sum."""
        return self.gpu and self.form != "additive"

    def predict_features(self, feats) -> np.ndarray:
        """Step times (P,) in seconds for (P, 5) features (see predictor.ops.FEATURES)."""
        feats = np.atleast_2d(np.asarray(feats, dtype=np.float64))
        t_c, t_m = self._op_times(feats)
        return self._combine(feats, t_c, t_m)[0]

    def predict_decode(self, batch_sizes, context_sums) -> np.ndarray:
        """Vectorized decode: step times (P,) for B sequences with ``context_sums`` cached tokens in total."""
        return self.predict_features(decode_features(batch_sizes, context_sums))

    def predict_time(self, batch, *, async_scheduling: bool = False) -> float:
        """Total step time (s) of one batch, no breakdown: the scheduler's hot path (pure Python).

        Same numbers as ``predict(batch).total_s``. With ``async_scheduling`` (vLLM V1's default on
        GPUs since it schedules step n+1 while the device runs step n), the host term S(N) overlaps
        the device work: a step takes ``max(device, host)`` instead of their sum. A CPU backend has
        no device queue to overlap with, so there the flag changes nothing.
        """
        f, decode, longest_decode = batch_sums(batch)
        num_new, num_seqs = f[1], f[2]
        attention = self._attention_parts(f, decode, longest_decode)
        expert_unread = 1.0 - float(self.graph.expert_read_fraction(num_new)) if self._expert_bytes else 0.0
        sms, (t_m_tile, t_n_tile) = self.hardware.num_sms, self.tile
        lat, bw = self._mem_latency_bytes, self._mem_bytes_per_s
        comp = mem = add = sample = 0.0
        last_seg = GEMM_ENVELOPE_SEGMENTS + 1
        for i, (fc, bc, rate, calls, gemm, is_sample, fixed) in enumerate(self._scalar_ops):
            flops = fc[0] * f[0] + fc[1] * f[1] + fc[2] * f[2] + fc[3] * f[3] + fc[4] * f[4]
            nbytes = bc[0] * f[0] + bc[1] * f[1] + bc[2] * f[2] + bc[3] * f[3] + bc[4] * f[4]
            if expert_unread and i in self._expert_bytes:
                nbytes -= expert_unread * self._expert_bytes[i]
            if gemm is not None:
                m, n, k = f[gemm[0]], gemm[1], gemm[2]
                tiles = math.ceil(max(m, 1.0) / t_m_tile) * math.ceil(n / t_n_tile)
                tiles *= max(1, min(sms // tiles, k // eff.MIN_SPLIT_K))
                rate = rate * (1.0 - self.wave * (1.0 - tiles / (math.ceil(tiles / sms) * sms))) * self._duty_ratio_scalar(m)
                t_c = min(flops / rate, self._scalar_env[i][min(math.ceil(max(m, 1.0) / t_m_tile), last_seg)])
            elif attention is not None and i == self._attn_index:
                t_c, t_m, t = attention
                comp += calls * t_c
                mem += calls * t_m
                add += calls * t
                continue
            else:
                t_c = flops / rate
            t_m = (nbytes + lat) / bw if nbytes > 0 else 0.0
            if is_sample:
                sample = max(t_c, t_m) + fixed
                continue
            comp += calls * t_c
            mem += calls * t_m
            add += calls * (max(t_c, t_m) + fixed)
        blocks = add if self.form == "additive" else max(comp, mem)
        if not self._launch_is_floor():
            launch = self.launch_s
        else:  # the max form's floor (written as in _combine so both paths agree to the bit)
            blocks, launch = max(blocks, self.launch_s), 0.0
        host = self.s_floor_s + self.s_slope_s * max(0.0, num_seqs - 1)
        if async_scheduling and self.gpu:  # a CPU has no device queue for the host to overlap
            return max(blocks + launch + sample, host)
        return blocks + launch + host + sample

    def predict_interval(self, batch) -> tuple[float, float] | None:
        """An 80 % interval (seconds) around ``predict_time(batch)`` from the calibration's own
        spread, or None when the calibration carries none (only the CPU op tables do so far)."""
        return None

    def predict_many(self, batches) -> np.ndarray:
        """Step times for a list of batches (each a list of (num_new_tokens, num_cached_tokens))."""
        if len(batches) == 0:
            return np.zeros(0)
        return self.predict_features(np.stack([batch_features(b) for b in batches]))

    # ---------------------------------------------------------------- one step with breakdown
    def predict(self, batch) -> StepPrediction:
        """Predict one step. ``batch``: list of (num_new_tokens, num_cached_tokens) per sequence."""
        self.check_fits(batch)
        feats = batch_features(batch)[None, :]
        t_c, t_m = self._op_times(feats)
        op_t = np.maximum(t_c, t_m) + self._op_fixed_s
        attention = self._attention_parts(*batch_sums(batch))
        if attention is not None:
            i = self._attn_index
            t_c[0, i], t_m[0, i], op_t[0, i] = attention
        total, parts = self._combine(feats, t_c, t_m, op_t)
        return roofline_prediction(self, feats, t_c, t_m, op_t, total, parts)

    def check_fits(self, batch) -> None:
        """One-line ConfigError when the weights plus the KV cache of ``batch`` do not fit in the
        device's memory (GPU: the total the driver reports; CPU: the host's memory). Not checked by
        ``predict_time``/``predict_many`` (the scheduler's hot path sizes its KV pool itself)."""
        d = DTYPE_BYTES[self.dtype]
        weights = self.model.weight_bytes(d)
        kv = sum(n + c for n, c in batch) * self.model.kv_bytes_per_token(d)
        memory = self.hardware.memory_bytes
        if memory and weights + kv > memory:
            gib = 1 << 30
            raise ConfigError(
                f"{self.model.name} in {self.dtype} does not fit on {self.hardware.sku_id}: weights "
                f"{weights / gib:.1f} GiB + KV cache {kv / gib:.1f} GiB for this batch > {memory / gib:.1f} GiB "
                f"of device memory")

    # ---------------------------------------------------------------- one op at a time
    def op_call_times(self, feats) -> np.ndarray:
        """Seconds per call of every op (columns in ``graph.names`` order) for (P, 5) features, as the
        vectorized path prices them; what ``gpubench silicon`` scores op by op. No memory-fit check."""
        t_c, t_m = self._op_times(np.atleast_2d(np.asarray(feats, dtype=np.float64)))
        return np.maximum(t_c, t_m) + self._op_fixed_s

    def attention_call_time(self, batch) -> float:
        """Seconds of one layer's attention op for ``batch``, as ``predict`` prices it. No memory-fit check."""
        parts = self._attention_parts(*batch_sums(batch))
        return parts[2] if parts is not None else float(self.op_call_times(batch_features(batch))[0, self._attn_index])

    # ---------------------------------------------------------------- physical floor
    def physical_floor_s(self, batch) -> float:
        """Lower bound no step can beat: max(total bytes / spec B, total FLOPs / spec peak)."""
        feats = batch_features(batch)[None, :]
        g = self.graph
        nbytes = float(g.totals(feats, "bytes")[0])
        flops = float(g.totals(feats, "flops")[0])
        return max(nbytes / self.hardware.mem_bytes_per_s, flops / self.hardware.peak(self.dtype))

    def __repr__(self) -> str:
        return (f"StepModel({self.hardware.sku_id}, {self.model.name}, dtype={self.dtype}, form={self.form}, "
                f"cuda_graphs={self.cuda_graphs})")


def _variant_name(hw: HardwareSpec, cal: Calibration, form: str, dtype: str) -> str:
    """Which variant prices this hardware and calibration (see the class docstring)."""
    if hw.backend != "cpu":
        return "gpu-roofline"
    if form == "additive" and cal.cpu_ops.get(dtype) is not None:
        return "cpu-op-tables"
    return "cpu-roofline"
