"""The fused kernels (predictor.fused_kernels): Triton's, run here under its interpreter, against the
torch fallbacks and against the eager engine's own arithmetic, op by op.

Triton decides at import whether its kernels are interpreted, so the Triton side runs in a child
process started with TRITON_INTERPRET=1 (this file run as a script); the test process never imports
Triton with the flag, and nothing else in it sees the flag.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from predictor.fused_kernels import Kernels, TorchKernels, choose, self_check
from predictor.torch_model import TorchCausalLM

HQ, HKV, D = 4, 2, 16


def _cases() -> dict:
    g = torch.Generator().manual_seed(0)
    T = 6
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(64).float(), inv)
    out = {"positions": torch.tensor([0, 3, 7, 7, 12, 30]), "cos": freqs.cos(), "sin": freqs.sin(),
           "qkv": torch.randn(T, (HQ + 2 * HKV) * D, generator=g),
           "gate_up": torch.randn(3, 2 * 1500, generator=g),  # 1500: more than one block
           "slots": torch.tensor([9, 2, 3, 15, 0, 7])}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[f"x_{name}"] = torch.randn(5, 48, generator=g).to(dtype)
        out[f"res_{name}"] = torch.randn(5, 48, generator=g).to(dtype)
        out[f"w_{name}"] = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    return out


def _apply(k: Kernels, c: dict) -> dict:
    """Every kernel of ``k`` on the cases; what each returned or wrote."""
    out = {}
    for name in ("fp32", "bf16"):
        out[f"rms_{name}"] = k.rms_norm(c[f"x_{name}"], c[f"w_{name}"], 1e-5)
        r = c[f"res_{name}"].clone()
        out[f"add_rms_{name}"] = k.add_rms_norm(c[f"x_{name}"], r, c[f"w_{name}"], 1e-5)
        out[f"residual_{name}"] = r
    buf = c["qkv"].clone()
    T = buf.shape[0]
    k.rope_(buf[:, :HQ * D].view(T, HQ, D), buf[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), c["positions"], c["cos"],
            c["sin"])
    out["rope_qkv"] = buf
    out["silu_and_mul"] = k.silu_and_mul(c["gate_up"])
    kc, vc = torch.zeros(16, HKV, D), torch.zeros(16, HKV, D)
    qkv = c["qkv"]
    k.write_kv_(qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), qkv[:, (HQ + HKV) * D:].view(T, HKV, D), kc, vc,
                c["slots"])
    out["k_cache"], out["v_cache"] = kc, vc
    return out


@pytest.fixture(scope="module")
def triton_out(tmp_path_factory) -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is missing: it is in the dev extra (pip install -e '.[all,dev]'), and these tests need it")
    path = tmp_path_factory.mktemp("triton") / "out.pt"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    subprocess.run([sys.executable, __file__, str(path)], check=True, env=env, timeout=300)
    return torch.load(path)


@pytest.fixture(scope="module")
def torch_out() -> dict:
    return _apply(TorchKernels(), _cases())


def _tol(name):
    return dict(atol=2e-2, rtol=2e-2) if name.endswith("bf16") else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_rms_norm_and_its_fused_residual_add_match_the_eager_norm(triton_out, torch_out, name):
    c = _cases()
    x, res, w = c[f"x_{name}"], c[f"res_{name}"], c[f"w_{name}"]
    for out in (torch_out, triton_out):
        torch.testing.assert_close(out[f"rms_{name}"], TorchCausalLM._rms(x, w, 1e-5), **_tol(name))
        torch.testing.assert_close(out[f"residual_{name}"], res + x, **_tol(name))  # the residual holds the sum
        torch.testing.assert_close(out[f"add_rms_{name}"], TorchCausalLM._rms(res + x, w, 1e-5), **_tol(name))


def test_rope_rotates_strided_q_and_k_in_place_as_the_eager_rotation(triton_out, torch_out):
    c = _cases()
    qkv, T = c["qkv"], c["qkv"].shape[0]
    cos = torch.cat((c["cos"], c["cos"]), -1)[c["positions"]][:, None]
    sin = torch.cat((c["sin"], c["sin"]), -1)[c["positions"]][:, None]
    want_q = TorchCausalLM._rotate(qkv[:, :HQ * D].view(T, HQ, D), cos, sin)
    want_k = TorchCausalLM._rotate(qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), cos, sin)
    for out in (torch_out, triton_out):
        buf = out["rope_qkv"]
        torch.testing.assert_close(buf[:, :HQ * D].view(T, HQ, D), want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(buf[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(buf[:, (HQ + HKV) * D:], qkv[:, (HQ + HKV) * D:])  # v untouched


def test_silu_and_mul_is_silu_of_the_first_half_times_the_second(triton_out, torch_out):
    gu = _cases()["gate_up"]
    want = torch.nn.functional.silu(gu[:, :1500]) * gu[:, 1500:]
    for out in (torch_out, triton_out):
        torch.testing.assert_close(out["silu_and_mul"], want, atol=1e-6, rtol=1e-5)


def test_write_kv_puts_each_token_in_its_slot_and_nowhere_else(triton_out, torch_out):
    c = _cases()
    T = c["qkv"].shape[0]
    k, v = c["qkv"][:, HQ * D:(HQ + HKV) * D].view(T, HKV, D), c["qkv"][:, (HQ + HKV) * D:].view(T, HKV, D)
    others = torch.ones(16, dtype=torch.bool)
    others[c["slots"]] = False
    for out in (torch_out, triton_out):
        torch.testing.assert_close(out["k_cache"][c["slots"]], k)
        torch.testing.assert_close(out["v_cache"][c["slots"]], v)
        assert not out["k_cache"][others].any() and not out["v_cache"][others].any()


def test_the_self_check_passes_triton_and_catches_a_wrong_or_failing_kernel(triton_out):
    assert triton_out["self_check"] == ""  # Triton's kernels (interpreted) against the fallbacks

    class OffByOne(TorchKernels):
        name = "off-by-one"

        def silu_and_mul(self, gate_up):
            return super().silu_and_mul(gate_up) + 1

    class Broken(TorchKernels):
        name = "broken"

        def rope_(self, q, k, positions, cos, sin):
            raise RuntimeError("no kernel image is available for execution on the device\nmore")

    assert "disagree with torch" in self_check(OffByOne(), torch.device("cpu"))
    assert self_check(Broken(), torch.device("cpu")) == ("broken kernels failed their self-check (RuntimeError: no "
                                                         "kernel image is available for execution on the device)")


def test_choose_takes_torch_on_the_cpu_and_refuses_triton_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    auto = choose("auto", torch.device("cpu"))
    assert auto.name == "torch" and auto.fallback_reason == "Triton kernels compile for CUDA devices (this is cpu)"
    with pytest.raises(ConfigError, match="Triton does not run on cpu"):
        choose("triton", torch.device("cpu"))
    with pytest.raises(ConfigError, match="use auto"):
        choose("cuda-c", torch.device("cpu"))


if __name__ == "__main__":  # the child process of triton_out: TRITON_INTERPRET=1 is set before Triton loads
    from predictor.fused_kernels import TritonKernels

    torch.save({**_apply(TritonKernels(), _cases()), "self_check": self_check(TritonKernels(), torch.device("cpu"))},
               sys.argv[1])
