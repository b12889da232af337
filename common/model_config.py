"""Transformer model configs: a HuggingFace ``config.json`` reduced to what step costs depend on.

Supported families: Llama, Mistral, Qwen2 (GQA, tied embeddings, optional qkv bias), Qwen3 (per-head
RMSNorm on q and k, an explicit ``head_dim`` that may differ from hidden/heads, no qkv bias) and the
mixture-of-experts families Mixtral (``num_local_experts``, ``num_experts_per_tok``, experts of
``intermediate_size``) and Qwen3-MoE (``num_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``; every layer sparse, no shared expert). Shipped
configs live in ``common/model_configs/<name>.json`` and are written from the models' public
dimensions; ``--model`` also takes a path to any ``config.json``, or a Hugging Face id (``org/name``)
already in the local Hugging Face cache (read from disk; nothing is ever downloaded).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from common.errors import ConfigError, UnknownModelError, suggest
from common.jsonio import read_json

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each head of q and k before rope
ALIASES = {
    "llama3.1-8b": "llama-3.1-8b", "llama-8b": "llama-3.1-8b", "llama-3-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b", "llama-70b": "llama-3.1-70b",
    "llama3.2-1b": "llama-3.2-1b", "llama-1b": "llama-3.2-1b",
    "qwen2.5-7b-instruct": "qwen2.5-7b", "qwen-7b": "qwen2.5-7b",
    "mistral-7b-v0.3": "mistral-7b", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
    "qwen3-8b-base": "qwen3-8b", "qwen3-0.6b-base": "qwen3-0.6b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x7b-instruct": "mixtral-8x7b", "mixtral": "mixtral-8x7b",
}
# Hugging Face repository ids of the shipped configs (what users type, e.g. from a vLLM command
# line); an id that is not a path on disk is looked up here, lower-cased, before being read as one.
HF_IDS = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b", "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b", "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b", "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "mistralai/mistral-7b-v0.3": "mistral-7b", "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "huggingfacetb/smollm2-135m": "smollm2-135m", "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "qwen/qwen3-8b": "qwen3-8b", "qwen/qwen3-8b-base": "qwen3-8b",
    "qwen/qwen3-0.6b": "qwen3-0.6b", "qwen/qwen3-0.6b-base": "qwen3-0.6b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b", "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    qk_norm: bool = False
    num_experts: int = 0  # 0: a dense MLP; else every layer's MLP is num_experts experts
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's gate/up width
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expert_params(self) -> int:
        """Weights of one expert (gate, up, down); 0 for a dense model."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    def layer_params(self) -> int:
        """Weights of one decoder layer: q,k,v,o projections (+bias), q/k norms (Qwen3), the MLP
        (gate/up/down, or the router and every expert's gate/up/down), two RMSNorms."""
        attn = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.is_moe:
            mlp = self.num_experts * self.hidden_size + self.num_experts * self.expert_params()
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp + 2 * self.hidden_size

    def active_layer_params(self) -> int:
        """Weights one token passes through in a layer: ``layer_params`` with only its top-k experts."""
        if not self.is_moe:
            return self.layer_params()
        return self.layer_params() - (self.num_experts - self.num_experts_per_tok) * self.expert_params()

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """0 extra parameters when tied (the embedding matrix is reused), but it is still read."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def param_count(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.lm_head_params() + self.hidden_size

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.param_count() * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes


def available_models() -> list[str]:
    files = resources.files("common").joinpath("model_configs")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def config_path(name: str) -> Path | None:
    """Path of a shipped config by name or alias, or None."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    p = resources.files("common").joinpath("model_configs", f"{key}.json")
    return Path(str(p)) if p.is_file() else None


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache, found the way huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_hf_config(model_id: str) -> Path | None:
    """``config.json`` of ``org/name`` in the local Hugging Face cache (the newest snapshot by
    mtime when several were downloaded), or None. Reads the disk only."""
    cache = hf_hub_cache()
    folder = "models--" + model_id.replace("/", "--")
    repo = cache / folder
    if not repo.is_dir() and cache.is_dir():
        # Hub ids are case-insensitive, the cache's folder names keep the case the id was fetched with.
        repo = next((p for p in cache.iterdir() if p.name.lower() == folder.lower()), repo)
    snapshots = [p for p in (repo / "snapshots").glob("*") if (p / "config.json").is_file()]
    if not snapshots:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime) / "config.json"


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped config by name/alias or Hugging Face id, any HF ``config.json`` (or a directory
    holding one), or an ``org/name`` id found in the local Hugging Face cache."""
    s = str(name_or_path)
    name = None
    if s.strip().lower() in HF_IDS and not Path(s).exists():
        s = HF_IDS[s.strip().lower()]
    elif s.count("/") == 1 and not s.startswith((".", "/")) and not Path(s).exists() and not s.endswith(".json"):
        cached = cached_hf_config(s.strip())
        if cached is None:
            raise ConfigError(
                f"model '{s}': not a shipped config's Hugging Face id and not in the local Hugging Face cache "
                "(looked for "
                f"{hf_hub_cache() / ('models--' + s.strip().replace('/', '--'))}/snapshots/*/config.json; "
                "set HF_HUB_CACHE or HF_HOME for another cache); nothing is downloaded, so pass a shipped config "
                f"({', '.join(available_models())}) or a path to the model's config.json")
        s, name = str(cached), s.strip().split("/")[1]
    path = config_path(s) if not (s.endswith(".json") or "/" in s or Path(s).exists()) else Path(s)
    if path is None:
        raise UnknownModelError(f"unknown model '{s}'{suggest(s, available_models() + list(ALIASES))}; "
                                f"known: {', '.join(available_models())}, or pass a path to a config.json")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    raw = read_json(path, error=ConfigError, what="a model config")
    if name is None:
        name = path.stem if path.name != "config.json" else path.parent.name
    return from_dict(raw, name=name, where=str(path))


def from_dict(raw: dict, *, name: str = "model", where: str = "config") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    mtype = raw.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise ConfigError(f"{where}: model_type '{mtype}' is not supported (supported: {', '.join(SUPPORTED_TYPES)})")

    def need(key):
        if key not in raw:
            raise ConfigError(f"{where}: missing field '{key}'")
        v = raw[key]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: field '{key}' must be a positive integer, got {v!r}")
        return v

    def opt(key, default):  # optional: absent or null means derived
        return default if raw.get(key) is None else need(key)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if raw.get("head_dim") is None and hidden % heads:
        # head_dim is derived as hidden / heads, which must then be whole (vLLM and HF refuse it too).
        raise ConfigError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                          "(and no head_dim is given)")
    head_dim = opt("head_dim", hidden // heads)
    kv_heads = opt("num_key_value_heads", heads)
    if heads % kv_heads:
        # grouped-query attention shares each KV head among a whole number of query heads
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    moe = _moe_fields(raw, mtype, need, where)
    return ModelConfig(
        name=name,
        model_type=mtype,
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=need("vocab_size"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", mtype == "qwen2")),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        qk_norm=mtype in QK_NORM_TYPES,
        **moe,
        raw=raw,
    )


def _moe_fields(raw: dict, mtype: str, need, where: str) -> dict:
    """num_experts, num_experts_per_tok and moe_intermediate_size of a Mixtral or Qwen3-MoE config."""
    if mtype == "mixtral":
        experts, width = need("num_local_experts"), need("intermediate_size")
    elif mtype == "qwen3_moe":
        experts, width = need("num_experts"), need("moe_intermediate_size")
        if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{where}: Qwen3-MoE configs with dense layers (mlp_only_layers, decoder_sparse_step "
                              "other than 1) are not supported")
    else:
        return {}
    top_k = need("num_experts_per_tok")
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok ({top_k}) exceeds the number of experts ({experts})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width)
