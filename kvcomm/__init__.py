"""kvcomm: KV-cache reuse, re-rotation, quantization and blending between agents.

The toolkit's public names are exported lazily, so importing ``kvcomm`` (the CLI does) does not pull
in torch or transformers until one of them is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "KVCache": "kvcomm.cache",
    "prefill": "kvcomm.cache",
    "continue_from": "kvcomm.cache",
    "greedy_generate": "kvcomm.cache",
    "load_model": "kvcomm.models",
    "rope_info": "kvcomm.models",
    "RopeInfo": "kvcomm.models",
    "rerotate": "kvcomm.rope",
    "reposition": "kvcomm.rope",
    "quantize": "kvcomm.quant",
    "dequantize": "kvcomm.quant",
    "QuantizedKVCache": "kvcomm.quant",
    "blend_prefill": "kvcomm.blend",
    "BlendResult": "kvcomm.blend",
    "reuse_prefill": "kvcomm.blend",
    "quant_report": "kvcomm.quant",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcomm' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
