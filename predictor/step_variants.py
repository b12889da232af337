"""The three step predictors (predictor.step): one interface, a type per way of pricing a step.

- :class:`GpuRooflineStep`: per-op roofline on a GPU; every kernel pays the device interval (the
  eager launch interval, or the CUDA-graph node interval); attention is priced per part and per
  sequence; the host term can overlap the device (asynchronous scheduling); a GEMM kernel pays its
  measured fixed time.
- :class:`CpuRooflineStep`: per-op roofline on the CPU; each op pays a framework dispatch; the
  memory law keeps its fixed term; nothing overlaps the host.
- :class:`CpuOpTableStep`: each op priced from the calibration's ``cpu_ops`` tables, what the
  ``torch_ops`` probe measured torch doing with that shape (predictor.cpu_step); its roofline parts
  stay for the breakdown, and it carries an 80 % interval from the tables' spread.

``StepModel(...)`` picks one (``predictor.step._variant_name``); each registers itself by its
``variant`` name when this module is imported (``predictor/__init__.py`` does).
"""
from __future__ import annotations

import numpy as np

from common.errors import ConfigError
from predictor.gpu_attention import AttentionOverheads
from predictor.ops import batch_features
from predictor.step import StepModel
from predictor.step_prediction import StepPrediction, table_prediction


class GpuRooflineStep(StepModel):
    """A GPU: kernels, device intervals, per-sequence attention, an asynchronous queue."""

    variant = "gpu-roofline"
    gpu = True

    def _memory_latency_and_gemm_fixed(self) -> tuple[float, float]:
        # NOTE(predictor): on a GPU the law's fixed term x_half * L2 / (B * eta_max) is what a
        # standalone cold transfer pays around its kernel (launch, ramp, drain). Inside a step that
        # per-kernel cost is the device interval charged to every kernel; keeping the term as well
        # charged it twice, and scaled with the L2 size (8 us per op on an H100, 59 us on an L40S
        # with its 96 MB L2: a Llama-3.1-8B decode at 45 ms instead of ~21). So a GPU op streams at
        # B * eta_max.
        # NOTE(predictor): a GEMM kernel's fixed time (ramp and tail, ~6 us on an H200), when the
        # calibration measured it (`gpubench fit`: the intercept of the gemm probe's time against
        # bytes at M = 1); its eta_duty(M) curve was then fitted on the time net of it, so the
        # probe's own shapes cost what they measured and a smaller GEMM still pays the fixed part.
        fixed = self.calibration.params.get("t_gemm_fixed_s")
        return 0.0, float(fixed.value) if fixed is not None else 0.0

    def _attention_overheads_and_share(self) -> tuple[AttentionOverheads, float]:
        # NOTE(predictor): measured attention kernels (FA2/FA3/FlashInfer, aiconfigurator's tables)
        # have a floor of ~10 us per kernel at short context (split-KV scheduling, the combine step,
        # prologue and epilogue) that grows with the sequences of the batch (each one's metadata,
        # CTAs and split combine); prefill pays per query tile (loading Q, the softmax epilogue,
        # writing O) on top of its causal FLOPs, which run under the GEMMs' tensor rate. All of it
        # comes only from a calibration that measured attention kernels (`fit --from-silicon`).
        v = self.calibration.value_or
        return AttentionOverheads(v("t_attn_fixed_s", 0.0), v("t_attn_seq_s", 0.0), v("t_attn_token_s", 0.0)), v("eta_attn", 1.0)

    def _launches(self) -> tuple[int, float]:
        v = self.calibration.value
        return self.graph.total_kernels(), v("t_graph_node_s") if self.cuda_graphs else v("t_launch_s")

    def _decode_attention_bound(self, feats: np.ndarray, t_c: np.ndarray, t_m: np.ndarray) -> None:
        # features carry no per-sequence detail: a decode-only row (T == S) is taken as S equal
        # sequences, which is what predict() computes for such a batch
        i = self._attn_index
        decode = feats[:, 1] == feats[:, 2]
        bound = self._attention.longest_sequence_bytes(feats[:, 2], feats[:, 4] / np.maximum(feats[:, 2], 1.0))
        t_m[:, i] = np.where(decode, np.maximum(t_m[:, i], bound / self._mem_bytes_per_s), t_m[:, i])
        # the per-sequence and per-prefill-token times add to the kernel's max(t_c, t_m), as
        # GpuAttention.price adds them (a row that is not decode-only counts all its new tokens)
        if self.attn_overheads.seq_s or self.attn_overheads.token_s:
            extra = self._attention.overhead_s(feats[:, 2], np.where(decode, 0.0, feats[:, 1]))
            t_c[:, i] += extra
            t_m[:, i] += extra

    def _attention_parts(self, f, decode, longest_decode) -> tuple[float, float, float]:
        prefill = (f[1] - decode[0], f[2] - decode[1], f[3] - decode[2], f[4] - decode[3])
        return self._gpu_attention(decode, prefill, longest_decode)

    def predict_many(self, batches) -> np.ndarray:
        # per batch: attention is priced per sequence, not from feature totals
        return np.array([self.predict_time(b) for b in batches]) if len(batches) else np.zeros(0)


class CpuRooflineStep(StepModel):
    """The CPU priced by the roofline: framework dispatches, the memory law with its fixed term."""

    variant = "cpu-roofline"

    def _memory_latency_and_gemm_fixed(self) -> tuple[float, float]:
        # the CPU has no launch interval to carry a transfer's fixed cost: the law keeps its term
        return self.x_half * self.hardware.l2_bytes, 0.0

    def _launches(self) -> tuple[int, float]:
        return self.graph.total_cpu_dispatches(), self.calibration.value("t_dispatch_s")


class CpuOpTableStep(CpuRooflineStep):
    """The CPU priced op by op from the calibration's measured ``cpu_ops`` tables."""

    variant = "cpu-op-tables"

    def _setup(self, hw, model, cal, **kw) -> None:
        super()._setup(hw, model, cal, **kw)
        tables = cal.cpu_ops.get(self.dtype)
        if tables is None or self.form != "additive":
            raise ConfigError(f"the CPU op tables need a calibration with cpu_ops for {self.dtype} and the additive "
                              f"form (got {'form ' + self.form if tables is not None else 'no tables'})")
        from predictor.cpu_step import CpuTableStep

        # "separate" is this project's torch engine, whose decode group is one SDPA call padded
        # to its longest sequence; "fused" is vLLM, whose attention reads each sequence's blocks.
        self.table = CpuTableStep(tables, self.model, self.gemm_layout, padded_decode=self.gemm_layout == "separate")
        self.cpu_table = self.table  # what StepModel says of every variant (None on the rooflines)

    def predict_time(self, batch, *, async_scheduling: bool = False) -> float:
        return self.table.predict_time(batch)

    def predict_features(self, feats) -> np.ndarray:
        feats = np.atleast_2d(np.asarray(feats, dtype=np.float64))
        return np.array([self.table.predict_time(_batch_from_features(f)) for f in feats])

    def predict_many(self, batches) -> np.ndarray:
        # per batch: the tables price sequences, not feature totals
        return np.array([self.predict_time(b) for b in batches]) if len(batches) else np.zeros(0)

    def predict_interval(self, batch) -> tuple[float, float]:
        low, high = self.table.tables.interval_factors()
        t = self.predict_time(batch)
        return t * low, t * high

    def predict(self, batch) -> StepPrediction:
        self.check_fits(batch)
        feats = batch_features(batch)[None, :]
        t_c, t_m = self._op_times(feats)  # the roofline parts, for the breakdown beside the tables
        return table_prediction(self, self.table.op_times([tuple(b) for b in batch]), feats, t_c, t_m)


def _batch_from_features(f) -> list:
    """A batch with the features' totals, for the CPU op tables (which price sequences, not totals):
    decode-only features (T == S) become S decodes sharing the C keys; otherwise one prefill
    sequence of T tokens over C - T cached (an approximation: callers with batches use them)."""
    num_new, num_seqs, kv_tokens = int(round(f[1])), int(round(f[2])), float(f[4])
    if num_new == num_seqs:
        per_seq = max(1.0, kv_tokens / max(num_seqs, 1) - 1.0)
        return [(1, per_seq)] * num_seqs
    return [(num_new, max(0.0, kv_tokens - num_new))]
