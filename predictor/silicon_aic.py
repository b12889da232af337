"""aiconfigurator's own decode-step estimate beside the composed steps (predictor.silicon_steps).

aiconfigurator (the same wheel whose tables are scored) estimates a serving step by composing per-op
latencies. Two of its modes are put beside the step model, on the very steps the tables compose:

- ``aiconfigurator`` (its SILICON mode): each op looked up, or interpolated, in the same tables the
  measured step is summed from. In-sample by construction: it shows what table lookup reaches and how
  much its interpolation between grid points costs, not how it would price a GPU it has no tables for.
- ``aiconfigurator SOL`` (its SOL mode): speed of light from the datasheet figures in its
  ``systems/<system>.yaml``, no table read: its counterpart of the step model's default pricing on a
  GPU nothing was measured on.

Both are scored on the kernels the composed step sums (its qkv, attention, o-proj, gate/up and down
ops over all layers; a model whose architecture it does not model, Mistral, gets no row); its
whole-step figure (embedding, norms, activation and the LM head added) is kept beside them as
``aic_step_s`` for context. Its decode step is asked at ``isl`` = context - 1 and
``osl`` = 2, which puts its attention at the composed step's cached length within a token.
"""
from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from common.errors import ConfigError
from common.model_config import config_path

MODES = {"aiconfigurator": "SILICON", "aiconfigurator SOL": "SOL"}
SAME_KERNELS = ("generation_qkv_gemm", "generation_attention", "generation_proj_gemm", "generation_gate_ffn1_gemm",
                "generation_ffn2_gemm")
MS = 1e-3


@contextmanager
def _quiet():
    """aiconfigurator logs a warning per fallback table it loads; a scoring run has no use for them."""
    log = logging.getLogger("aiconfigurator_core")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _engine(model_dir: str, system: str, framework: str, mode: str):
    """aiconfigurator's compiled step estimator of one model on one system in one database mode."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk import engine as aic
    from aiconfigurator_core.sdk.common import DatabaseMode

    if mode == "SILICON":
        return aic.EngineHandle.compile(model_dir, system, framework)
    # compile_engine with the database's default mode switched for the spec build (the same steps it
    # takes; it has no mode argument), then switched back: the database object is shared
    mc = aic.build_model_config(tp_size=1, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1,
                                gemm_quant_mode=None, kvcache_quant_mode=None, fmha_quant_mode=None, moe_quant_mode=None,
                                comm_quant_mode=None, forward_model=None, attention_backend=None)
    aic.apply_nextn(mc, 0)
    model = aic.get_model(model_dir, mc, framework)
    version = aic._literal_backend_version(system, framework, None, None, None)
    db = aic._maybe_load_database(system, framework, version, None)
    before = db.get_default_database_mode()
    db.set_default_database_mode(DatabaseMode[mode])
    try:
        spec = aic.build_engine_spec_json(model, model_path=model_dir, system=system, backend=framework,
                                          backend_version=version, kv_block_size=None, systems_path=None,
                                          nextn=mc.nextn, database=db)
    finally:
        db.set_default_database_mode(before)
    return aic.EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)))


def aic_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Rows in the shape of ``steps`` (predictor.silicon_steps.composed_steps with its labels) for
    aiconfigurator's two modes, on each (system, framework, model, batch, context) ``steps`` holds."""
    if not len(steps):
        return steps.iloc[0:0]
    keys = ["system", "sku", "framework", "version", "model", "step", "batch", "context", "chunk"]
    cells = steps.drop_duplicates(keys)[keys + ["measured_s", "gemm_measured_s", "attention_measured_s"]]
    out = []
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        for (system, framework, model), g in cells.groupby(["system", "framework", "model"], sort=False):
            model_dir = Path(tmp) / model  # aiconfigurator reads a Hugging Face config directory
            model_dir.mkdir(exist_ok=True)
            shipped = config_path(model)
            if shipped is None:  # composed steps only hold shipped models
                raise ConfigError(f"{model}: not a shipped model config")
            (model_dir / "config.json").write_text(shipped.read_text())
            for name, mode in MODES.items():
                try:
                    eng = _engine(str(model_dir), system, framework, mode)
                except ValueError as e:
                    if "is not supported" in str(e):  # an architecture it does not model (Mistral): no row
                        break
                    raise ConfigError(f"aiconfigurator could not build its {mode} estimator of {model} on "
                                      f"{system} ({framework}): {e}") from None
                except Exception as e:  # the peer's own failure, reported in one line
                    raise ConfigError(f"aiconfigurator could not build its {mode} estimator of {model} on "
                                      f"{system} ({framework}): {type(e).__name__}: {e}") from None
                for r in g.itertuples():
                    ops = {op: ms * MS for op, ms, _energy, _src in eng.decode_step_per_op(int(r.batch), int(r.context) - 1, 2)}
                    row = r._asdict()
                    row.pop("Index")
                    out.append({**row, "predictor": name, "predicted_s": sum(ops[k] for k in SAME_KERNELS),
                                "aic_step_s": sum(ops.values())})
    df = pd.DataFrame(out)
    df["signed_pct"] = (df["predicted_s"] - df["measured_s"]) / df["measured_s"] * 100
    df["ape_pct"] = df["signed_pct"].abs()
    return df


def add_aiconfigurator(score) -> None:
    """Append aiconfigurator's rows to ``score.steps`` (a SiliconScore), once per composed step."""
    if len(score.steps):  # decode steps only: its mixed step prices attention otherwise than the tables measure it
        decode = score.steps[score.steps["step"] == "decode"]
        score.steps = pd.concat([score.steps, aic_steps(decode)], ignore_index=True)
