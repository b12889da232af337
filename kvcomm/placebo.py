"""The placebo protocol: text's own K/V plus noise of a matched KL, to see how often answers flip by chance.

Any protocol that imports K/V moves B's first-token distribution by some KL on each example, and some
of B's answers change only because the distribution moved, whatever moved it. The placebo measures
that floor. B computes exactly what ``text`` computes for everything before the question (its prefix,
the imported spans, the separators), then adds Gaussian noise to the imported spans' keys and values
at every layer, with standard deviation ``sigma`` times that layer's RMS over those spans (one
``sigma`` for every layer; the noise is drawn once per example from a seeded generator), and computes
the question on top. ``sigma`` is set per example, by bisection, so that KL(text || placebo) of B's
first token equals the KL the matched protocol (``MATCHED_PROTOCOL``) has on that example, within
``KL_TOLERANCE`` of it or after ``MAX_HALVINGS`` halvings.

The share of text's right answers the placebo loses is the flip floor: a protocol that loses no more
than that loses answers as a random perturbation of the same size would; one that loses more is wrong
in a way that noise of its KL is not. The placebo's TTFT is not a protocol's (B computed everything);
its rows are a reference, never judged against the goal.
"""
from __future__ import annotations

import time

import torch

from kvcomm.cache import KVCache, continue_from
from kvcomm.layout import Layout
from kvcomm.metrics import first_token_kl
from kvcomm.protocols import Reception

MATCHED_PROTOCOL = "kv-rerotated"  # the sender's own K/V moved into place, nothing recomputed
KL_TOLERANCE = 0.1  # relative
MAX_HALVINGS = 14
MAX_SIGMA = 64.0


def _import_mask(layout: Layout, prefix_tokens: int, num_tokens: int) -> torch.Tensor:
    """[num_tokens] bool over the cache after B's prefix: True on imported tokens."""
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    start = 0
    for seg in layout.segments:
        if seg.kind == "import":
            mask[start - prefix_tokens:start - prefix_tokens + len(seg.ids)] = True
        start += len(seg.ids)
    return mask


def _unit_noise(cache: KVCache, mask: torch.Tensor, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K and V noise at sigma = 1: standard normal draws times the layer's RMS over the
    imported tokens, zero elsewhere. Drawn and scaled once; the bisection only multiplies by sigma."""
    out = []
    for k, v in zip(cache.keys, cache.values):
        noise_k = torch.randn(k.shape, generator=gen, dtype=k.dtype) * mask[:, None]
        noise_v = torch.randn(v.shape, generator=gen, dtype=v.dtype) * mask[:, None]
        out.append((noise_k * k[..., mask, :].pow(2).mean().sqrt(), noise_v * v[..., mask, :].pow(2).mean().sqrt()))
    return out


def _noised(cache: KVCache, noise: list[tuple[torch.Tensor, torch.Tensor]], sigma: float) -> KVCache:
    return KVCache(keys=[k + sigma * nk for k, (nk, _) in zip(cache.keys, noise)],
                   values=[v + sigma * nv for v, (_, nv) in zip(cache.values, noise)],
                   positions=cache.positions, token_ids=cache.token_ids)


@torch.no_grad()
def placebo_reception(model, layout: Layout, prefix: KVCache, text_logits: torch.Tensor, target_kl: float,
                     seed: int) -> Reception:
    """B's reception under the placebo whose first-token KL to ``text_logits`` is ``target_kl``.

    ``extra`` records the ``sigma`` found, the KL reached and the target. With ``target_kl`` 0 (or
    not finite) the placebo is ``text`` itself (sigma 0).
    """
    t0 = time.perf_counter()
    question = layout.segments[-1].ids
    before = layout.ids[prefix.num_tokens:len(layout.ids) - len(question)]
    context, _ = continue_from(model, prefix, before, last_only=True)
    tail = context.slice(prefix.num_tokens)
    mask = _import_mask(layout, prefix.num_tokens, tail.num_tokens)
    noise = _unit_noise(tail, mask, torch.Generator().manual_seed(seed))

    def at(sigma: float) -> tuple[float, KVCache, torch.Tensor]:
        cache = KVCache.concat([prefix, _noised(tail, noise, sigma)])
        cache, logits = continue_from(model, cache, question, last_only=True)
        return first_token_kl(text_logits, logits[0, -1]), cache, logits[0, -1]

    target = float(target_kl) if target_kl == target_kl and target_kl > 0 else 0.0
    lo, hi = 0.0, 0.25
    kl, cache, logits = at(0.0 if target == 0.0 else hi)
    while target > 0 and kl < target and hi < MAX_SIGMA:  # grow until the target is bracketed
        lo, hi = hi, 2 * hi
        kl, cache, logits = at(hi)
    sigma = 0.0 if target == 0.0 else hi
    for _ in range(MAX_HALVINGS if target > 0 else 0):
        if abs(kl - target) <= KL_TOLERANCE * target:
            break
        sigma = (lo + hi) / 2
        kl, cache, logits = at(sigma)
        lo, hi = (sigma, hi) if kl < target else (lo, sigma)
    return Reception(cache=cache, last_logits=logits, num_imported=layout.num_imported,
                     num_recomputed=layout.num_imported, prefill_s=time.perf_counter() - t0,
                     extra={"placebo": {"sigma": sigma, "kl": kl, "target_kl": target, "matched": MATCHED_PROTOCOL}})
