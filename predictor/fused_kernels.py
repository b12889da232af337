"""The fused elementwise kernels a serving engine runs between its GEMMs, in Triton with torch fallbacks.

An eager torch layer launches ~20 elementwise kernels (norm, residual add, RoPE's slices and cats,
SiLU, multiply, the KV write's index_put); vLLM launches 4: add+RMSNorm, RoPE applied to q and k in
place, SiLU-and-multiply, and the cache write. These are those four, with the same contracts:

- ``rms_norm(x, w, eps)`` and ``add_rms_norm(x, residual, w, eps)``: the residual is updated in place
  (``residual += x``) and the norm of the sum returned, as vLLM's ``fused_add_rms_norm``; the
  variance is taken in fp32 and the normalized row cast back before the weight multiplies it, as
  transformers' LlamaRMSNorm does (the eager engine's arithmetic).
- ``rope_(q, k, positions, cos, sin)``: NeoX-style rotation (the two halves of each head) of q and k
  in place, from cos/sin tables of [max_pos, head_dim/2]; q and k may be strided views of one qkv
  output.
- ``silu_and_mul(gate_up)``: silu(first half) * second half of each row.
- ``write_kv_(k, v, k_cache, v_cache, slot_mapping)``: token t's K/V to flat slot ``slot_mapping[t]``
  of a token-major cache ([slots, kv_heads, head_dim]). Every slot is real: the graph engine
  captures each batch shape as it is and pads nothing.

Two implementations with one interface (:class:`Kernels`): ``triton`` (one program per token row; it
runs on a GPU, and on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the
tests check it here) and ``torch`` (plain tensor ops; the CPU's and the fallback where Triton is
missing). Both are graph-capturable on a GPU: no host synchronization, no allocation that depends
on values.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from predictor.torch_model import TorchCausalLM

IMPLEMENTATIONS = ("triton", "torch")


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Triton compiles for CUDA devices; on the CPU it runs only under its interpreter."""
    if not triton_importable():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def choose(implementation: str, device: torch.device) -> "Kernels":
    """``auto``: Triton where it runs on ``device`` and agrees with torch on a self-check, else torch
    (with the reason in ``fallback_reason``); a named one is taken as asked."""
    if implementation == "auto":
        if device.type != "cuda" or not triton_runs_on(device):
            fallback = TorchKernels()
            fallback.fallback_reason = ("Triton is not installed" if not triton_importable() else
                                        f"Triton kernels compile for CUDA devices (this is {device.type})")
            return fallback
        why = self_check(TritonKernels(), device)
        if why:
            fallback = TorchKernels()
            fallback.fallback_reason = why
            return fallback
        implementation = "triton"
    if implementation == "triton":
        if not triton_runs_on(device):
            from common.errors import ConfigError

            raise ConfigError(f"--kernels triton: Triton does not run on {device.type} here "
                              "(install triton; on the CPU set TRITON_INTERPRET=1, which is slow and meant for tests)")
        return TritonKernels()
    if implementation == "torch":
        return TorchKernels()
    from common.errors import ConfigError

    raise ConfigError(f"--kernels '{implementation}': use auto, {' or '.join(IMPLEMENTATIONS)}")


class Kernels:
    """The four fused operations (see the module docstring for each contract)."""

    name = "?"
    fallback_reason = ""  # why ``auto`` did not take Triton ("" when it did, or when asked by name)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def rope_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        raise NotImplementedError

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_kv_(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError


class TorchKernels(Kernels):
    """Plain torch: several kernels each on a GPU, the same arithmetic as the Triton ones."""

    name = "torch"

    def rms_norm(self, x, w, eps):
        return TorchCausalLM._rms(x, w, eps)  # the eager engine's arithmetic, exactly

    def add_rms_norm(self, x, residual, w, eps):
        residual.add_(x)
        return self.rms_norm(residual, w, eps)

    def rope_(self, q, k, positions, cos, sin):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, d/2]
        for x in (q, k):
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
            r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
            x1.copy_(r1)
            x2.copy_(r2)

    def silu_and_mul(self, gate_up):
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]

    def write_kv_(self, k, v, k_cache, v_cache, slot_mapping):
        # index_copy_ on flat slots: one scatter kernel per tensor, where an advanced-index
        # assignment builds index tensors and launches several.
        k_cache.index_copy_(0, slot_mapping, k.reshape(-1, *k_cache.shape[1:]))
        v_cache.index_copy_(0, slot_mapping, v.reshape(-1, *v_cache.shape[1:]))


class TritonKernels(Kernels):
    """One Triton program per token row (see predictor.triton_kernels for the kernels themselves)."""

    name = "triton"

    def __init__(self):
        from predictor import triton_kernels

        self._k = triton_kernels

    def rms_norm(self, x, w, eps):
        out = torch.empty_like(x)
        self._k.rms_norm(x, None, w, out, eps)
        return out

    def add_rms_norm(self, x, residual, w, eps):
        out = torch.empty_like(x)
        self._k.rms_norm(x, residual, w, out, eps)
        return out

    def rope_(self, q, k, positions, cos, sin):
        self._k.rope(q, k, positions, cos, sin)

    def silu_and_mul(self, gate_up):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._k.silu_and_mul(gate_up, out)
        return out

    def write_kv_(self, k, v, k_cache, v_cache, slot_mapping):
        self._k.write_kv(k, v, k_cache, v_cache, slot_mapping)


def self_check(kernels: Kernels, device: torch.device) -> str:
    """"" when ``kernels`` computes what the torch fallbacks compute on small inputs, else why not
    (an exception while compiling or running counts: the engine then runs the fallbacks)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    try:
        ref, got = TorchKernels(), kernels
        x, res, w = rand(3, 64), rand(3, 64), rand(64)
        pairs = [(ref.rms_norm(x, w, 1e-5), got.rms_norm(x, w, 1e-5))]
        r1, r2 = res.clone(), res.clone()
        pairs += [(ref.add_rms_norm(x, r1, w, 1e-5), got.add_rms_norm(x, r2, w, 1e-5)), (r1, r2)]
        gu = rand(3, 96)
        pairs.append((ref.silu_and_mul(gu), got.silu_and_mul(gu)))
        qkv, pos = rand(3, 8 * 16), torch.tensor([0, 5, 9], device=device)
        cos, sin = rand(16, 8), rand(16, 8)
        a, b = qkv.clone(), qkv.clone()
        ref.rope_(a[:, :64].view(3, 4, 16), a[:, 64:96].view(3, 2, 16), pos, cos, sin)
        got.rope_(b[:, :64].view(3, 4, 16), b[:, 64:96].view(3, 2, 16), pos, cos, sin)
        pairs.append((a, b))
        kc1, vc1 = torch.zeros(8, 2, 16, device=device, dtype=dt), torch.zeros(8, 2, 16, device=device, dtype=dt)
        kc2, vc2 = kc1.clone(), vc1.clone()
        slots = torch.tensor([6, 1, 3], device=device)
        k, v = qkv[:, 64:96].view(3, 2, 16), qkv[:, 96:].view(3, 2, 16)
        ref.write_kv_(k, v, kc1, vc1, slots)
        got.write_kv_(k, v, kc2, vc2, slots)
        pairs += [(kc1, kc2), (vc1, vc2)]
        err = max(float((p.float() - q.float()).abs().max()) for p, q in pairs)
    except Exception as e:  # a kernel that does not compile or run here means: use the fallbacks
        return f"{kernels.name} kernels failed their self-check ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    return "" if err <= 5e-2 else f"{kernels.name} kernels disagree with torch on their self-check (max |diff| {err:.3g})"
