"""How long one engine step takes, given the batch composition.

The engine describes a step by five counts (no per-request lists, so a decode step allocates
nothing): prefill tokens and sequences, the cached context those prefills attend to, decode
sequences and their summed context. A :class:`StepCost` maps that to seconds.

- :class:`ConstantStepCost` and :class:`TableStepCost` are for tests and hand-checkable scenarios.
- :class:`MeasuredStepCost` takes the step times a replay directory recorded (a live vLLM replay's
  ``steps.csv``): not a prediction, a way to tell the scheduler's logic from the predictor's timing.
- :class:`PredictorStepCost` asks ``predictor.StepModel`` for the SKU and model, memoized on a
  quantized key (see :func:`quantize`), so a replay of millions of steps calls the predictor only a
  few thousand times.
- :class:`JitteredStepCost` multiplies another cost's steps by seeded random factors: a real
  engine's step-to-step noise, for replays whose routes depend on timing.
"""
from __future__ import annotations

import bisect
import math
import statistics
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Mapping

# Relative granularity of the memo key: counts above QUANT_EXACT_BELOW are rounded *up* to
# 1/QUANT_STEPS_PER_OCTAVE of their octave (at most 1/32 = 3.1 % above the true value).
QUANT_EXACT_BELOW = 64
QUANT_STEPS_PER_OCTAVE = 32


_QUANT_SHIFT = 1 + int(math.log2(QUANT_STEPS_PER_OCTAVE))


def quantize(x: int) -> int:
    """Round a token count up onto a geometric grid (exact below 64, then <= 3.1 % coarser).

    Why: decode context sums grow by one token per sequence per step, so an exact key would
    never repeat; step time is smooth in these counts, so a 3 % grid changes it by well under 3 %.
    Rounding up keeps the estimate on the slow (conservative) side. The map is monotone and
    ``quantize(quantize(x)) == quantize(x)``, so every count in ``[x, quantize(x)]`` has the same
    key (what :meth:`StepCost.decode_quantum` relies on).
    """
    if x <= QUANT_EXACT_BELOW:
        return x
    shift = x.bit_length() - _QUANT_SHIFT
    if shift <= 0:
        return x
    return -(-x >> shift) << shift


class StepCost(ABC):
    """Seconds of one engine step. Implementations must be pure functions of their arguments."""

    @abstractmethod
    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        """Duration of a step.

        Args:
            num_prefill_tokens: new tokens of sequences that are (re)filling their prompt.
            num_prefill_seqs: how many such sequences.
            prefill_context_tokens: cached tokens those prefills attend to (sum over them).
            num_decode_seqs: sequences generating one token each.
            decode_context_tokens: context length summed over the decode sequences.
        """

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        """``(seconds, dmax)``: the duration of a step that only decodes ``num_decode_seqs``
        sequences with ``decode_context_tokens`` of summed context, and the largest summed context
        up to which the same ``num_decode_seqs`` gives the same seconds. The engine's pure-decode
        loop asks again only when the context passes ``dmax``. Exact by default (``dmax`` is the
        context itself); a cost that is constant over a range may say so.
        """
        return (self.step_s(num_prefill_tokens=0, num_prefill_seqs=0, prefill_context_tokens=0,
                            num_decode_seqs=num_decode_seqs, decode_context_tokens=decode_context_tokens),
                decode_context_tokens)

    def expected(self) -> "StepCost":
        """The cost without noise, for estimates (a policy's or router's guess of a prefill's time)."""
        return self

    def describe(self) -> str:
        return type(self).__name__


class ConstantStepCost(StepCost):
    """Every non-empty step takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"step seconds must be > 0, got {seconds}")
        self.seconds = float(seconds)

    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        return self.seconds

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        return self.seconds, sys.maxsize

    def describe(self) -> str:
        return f"constant:{self.seconds}"


class TableStepCost(StepCost):
    """Step time looked up by the number of tokens in the batch (prefill + decode).

    Args:
        table: ``{max_tokens: seconds}``; a step with ``n`` tokens takes the seconds of the smallest
            key ``>= n`` (a step above the largest key takes the largest key's seconds, scaled
            linearly by ``n / key``).
    """

    def __init__(self, table: Mapping[int, float]) -> None:
        if not table:
            raise ValueError("empty step-cost table")
        self._keys = sorted(int(k) for k in table)
        self._vals = [float(table[k]) for k in self._keys]

    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        n = num_prefill_tokens + num_decode_seqs
        i = bisect.bisect_left(self._keys, n)
        if i == len(self._keys):
            return self._vals[-1] * n / self._keys[-1]
        return self._vals[i]

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        # Only the token count (here: the number of decodes) matters, not the context.
        return (self.step_s(num_prefill_tokens=0, num_prefill_seqs=0, prefill_context_tokens=0,
                            num_decode_seqs=num_decode_seqs, decode_context_tokens=decode_context_tokens),
                sys.maxsize)

    def describe(self) -> str:
        return f"table:{dict(zip(self._keys, self._vals))}"


class MeasuredStepCost(StepCost):
    """Step time looked up in the steps a replay recorded: the median measured duration of its steps
    with the same ``(prefill tokens, prefill sequences, decode sequences)``.

    A composition the recording never ran takes the recorded one with the same sequence counts and
    the nearest prefill token count (or, with no such step, the nearest total token count), scaled
    by the ratio of scheduled tokens. Contexts are not keyed: a replay's ``steps.csv`` does not record
    them, and within one small replay they move step time far less than the token counts do.

    Why: under eviction pressure a closed-loop replay is sensitive to timing (a turn that arrives a
    step later finds other blocks cached), so comparing a simulator driven by the predictor with a
    live run mixes the predictor's timing error with any difference in scheduling. Replaying the
    live run's own step times isolates the second. Never a prediction: it is fitted on the run it
    is compared with.
    """

    def __init__(self, steps, source: str = "steps") -> None:
        by_key: dict[tuple[int, int, int], list[float]] = {}
        for prefill_tokens, prefill_seqs, decode_seqs, seconds in steps:
            if not seconds > 0:
                continue  # a recorded step always took time; a zero is a missing value
            by_key.setdefault((int(prefill_tokens), int(prefill_seqs), int(decode_seqs)), []).append(float(seconds))
        if not by_key:
            raise ValueError(f"no timed steps in {source}")
        self._median = {k: statistics.median(v) for k, v in by_key.items()}
        self._by_counts: dict[tuple[int, int], list[int]] = {}
        for prefill_tokens, prefill_seqs, decode_seqs in sorted(self._median):
            self._by_counts.setdefault((prefill_seqs, decode_seqs), []).append(prefill_tokens)
        self.source = source
        self.num_recorded_steps = sum(len(v) for v in by_key.values())

    @classmethod
    def from_replay_dir(cls, path) -> "MeasuredStepCost":
        """From ``DIR/steps.csv`` (or that file itself), as ``gpubench replay`` writes it."""
        import csv
        from pathlib import Path

        from common.errors import ConfigError

        path = Path(path)
        csv_path = path / "steps.csv" if path.is_dir() else path
        if not csv_path.is_file():
            raise ConfigError(f"measured step cost: no steps.csv at {path}")
        with csv_path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            need = {"dur_s", "num_prefill_tokens", "num_prefill_seqs", "num_decode_seqs"}
            if not need <= set(reader.fieldnames or ()):
                raise ConfigError(f"{csv_path} lacks the columns {sorted(need - set(reader.fieldnames or ()))}")
            try:
                rows = [(int(r["num_prefill_tokens"]), int(r["num_prefill_seqs"]), int(r["num_decode_seqs"]),
                         float(r["dur_s"])) for r in reader]
            except ValueError as e:
                raise ConfigError(f"{csv_path}: {e}") from None
        try:
            return cls(rows, source=str(csv_path))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _lookup(self, prefill_tokens: int, prefill_seqs: int, decode_seqs: int) -> float:
        exact = self._median.get((prefill_tokens, prefill_seqs, decode_seqs))
        if exact is not None:
            return exact
        candidates = self._by_counts.get((prefill_seqs, decode_seqs))
        if candidates:
            i = bisect.bisect_left(candidates, prefill_tokens)
            near = min(candidates[max(0, i - 1): i + 1], key=lambda t: abs(t - prefill_tokens))
            key = (near, prefill_seqs, decode_seqs)
        else:
            total = prefill_tokens + decode_seqs
            key = min(self._median, key=lambda k: (abs(k[0] + k[2] - total), k))
        scheduled = max(1, key[0] + key[2])
        return self._median[key] * max(1, prefill_tokens + decode_seqs) / scheduled

    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        return self._lookup(num_prefill_tokens, num_prefill_seqs, num_decode_seqs)

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        return self._lookup(0, 0, num_decode_seqs), sys.maxsize  # the context is not keyed

    def describe(self) -> str:
        return f"measured:{self.source} ({len(self._median)} compositions from {self.num_recorded_steps} steps)"


class PredictorStepCost(StepCost):
    """``predictor.StepModel`` for a SKU and model, memoized on a quantized batch key.

    Key: ``(q(prefill tokens), prefill seqs, q(prefill context), decode seqs, q(decode context))``
    with :func:`quantize`; sequence counts stay exact (they set the number of attention launches
    and the lm_head rows). The batch handed to the predictor is the representative one for the key:
    the prefill tokens and their context split evenly over the prefill sequences, and each decode
    sequence at the mean decode context.

    Built from names (no ``step_model``), instances with the same SKU, model, calibration and
    graph mode share one StepModel and one memo per process: a sweep worker replays many cells
    per SKU, and a prediction is a pure function of the key, so the next cell starts warm.
    (A calibration file is read once per process.)
    """

    _SHARED: "OrderedDict[tuple, tuple]" = OrderedDict()  # names -> (StepModel, memo), LRU
    _SHARED_MAX = 8

    def __init__(self, sku: str, model: str, *, calibration: str | None = None, cuda_graphs: bool = True,
                 async_scheduling: bool = True, step_model=None) -> None:
        if step_model is None:
            names = (sku, model, calibration, cuda_graphs, async_scheduling)
            shared = self._SHARED.get(names)
            if shared is None:
                from predictor import Calibration, StepModel, hardware_for_calibration  # the public API only (docs/interfaces.md)

                # The simulator replays vLLM's engine: fused qkv / gate_up projections (this matters
                # only to the CPU op tables; GPU forms price by shape either way). A CPU calibration
                # prices the CPU it was fitted on, so a replay regenerates alike on any host. The file
                # is read once for both (a CPU calibration carries its op tables).
                cal = Calibration.load(calibration) if calibration is not None else None
                shared = (StepModel(hardware_for_calibration(sku, cal), model, calibration=cal, cuda_graphs=cuda_graphs,
                                    gemm_layout="fused"), {})
                self._SHARED[names] = shared
                if len(self._SHARED) > self._SHARED_MAX:
                    self._SHARED.popitem(last=False)
            self._SHARED.move_to_end(names)
            step_model, memo = shared
        else:
            memo = {}
        self.sku, self.model_name = sku, model
        self.async_scheduling = async_scheduling
        self._model = step_model
        self._memo: dict[tuple, float] = memo
        self.num_predictor_calls = 0

    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        key = (quantize(num_prefill_tokens), num_prefill_seqs, quantize(prefill_context_tokens),
               num_decode_seqs, quantize(decode_context_tokens))
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self._predict(*key)
        return t

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        # The memo key of a pure-decode step; every context up to quantize(context) shares it.
        q = quantize(decode_context_tokens)
        key = (0, 0, 0, num_decode_seqs, q)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self._predict(*key)
        return t, q

    def _predict(self, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
                 num_decode_seqs: int, decode_context_tokens: int) -> float:
        batch: list[tuple[int, int]] = []
        if num_prefill_seqs:
            base, extra = divmod(num_prefill_tokens, num_prefill_seqs)
            for i in range(num_prefill_seqs):
                batch.append((base + (1 if i < extra else 0), prefill_context_tokens // num_prefill_seqs))
        if num_decode_seqs:
            batch.extend([(1, decode_context_tokens // num_decode_seqs)] * num_decode_seqs)
        self.num_predictor_calls += 1
        return float(self._model.predict_time(batch, async_scheduling=self.async_scheduling))

    def describe(self) -> str:
        return f"predictor:{self.sku}:{self.model_name}" + ("" if self.async_scheduling else ":sync")


class JitteredStepCost(StepCost):
    """``base``'s step times, each multiplied by an independent lognormal factor of mean 1 and
    coefficient of variation ``cv``, drawn from a generator seeded with ``seed``.

    Why: a real engine's steps of one shape vary from step to step (repeated vLLM engine steps on a
    2-vCPU VM: 5-15 %). One engine's JCT barely notices, but a router that reads the order turns
    finish in or the replicas' load at an instant (round robin, least loaded) then sends a turn
    elsewhere, and its context with it: a deterministic replay is one path of many, as one live take
    is. Replays under several seeds give the spread of those paths.

    Not a pure function of its arguments (the one StepCost that is not): every call draws, and
    ``decode_quantum`` says no other context shares its seconds, so each decode step draws its own.
    The same seed and the same event order give the same draws.
    """

    def __init__(self, base: StepCost, cv: float, seed: int) -> None:
        import random

        if not (math.isfinite(cv) and cv > 0):
            raise ValueError(f"the jitter's coefficient of variation must be > 0, got {cv}")
        self.base, self.cv, self.seed = base, float(cv), int(seed)
        # log N(mu, sigma) has mean exp(mu + sigma^2 / 2) = 1 and CV sqrt(exp(sigma^2) - 1) = cv.
        self._sigma = math.sqrt(math.log1p(cv * cv))
        self._mu = -self._sigma * self._sigma / 2
        self._rng = random.Random(seed)

    def _factor(self) -> float:
        return math.exp(self._rng.gauss(self._mu, self._sigma))

    def step_s(self, *, num_prefill_tokens: int, num_prefill_seqs: int, prefill_context_tokens: int,
               num_decode_seqs: int, decode_context_tokens: int) -> float:
        return self.base.step_s(num_prefill_tokens=num_prefill_tokens, num_prefill_seqs=num_prefill_seqs,
                                prefill_context_tokens=prefill_context_tokens, num_decode_seqs=num_decode_seqs,
                                decode_context_tokens=decode_context_tokens) * self._factor()

    def decode_quantum(self, num_decode_seqs: int, decode_context_tokens: int) -> tuple[float, int]:
        seconds, _ = self.base.decode_quantum(num_decode_seqs, decode_context_tokens)
        return seconds * self._factor(), decode_context_tokens

    def expected(self) -> StepCost:
        return self.base.expected()

    def describe(self) -> str:
        return f"{self.base.describe()} x jitter(cv={self.cv:g}, seed={self.seed})"


def make_step_cost(spec: str, *, sku: str, model: str, calibration: str | None = None,
                   cuda_graphs: bool = True, async_scheduling: bool = True) -> StepCost:
    """Build a step cost from a picklable spec: ``predictor``, ``constant:SECONDS`` or
    ``measured:DIR`` (the step times ``DIR/steps.csv`` recorded)."""
    from common.errors import ConfigError

    if spec == "predictor":
        return PredictorStepCost(sku, model, calibration=calibration, cuda_graphs=cuda_graphs,
                                 async_scheduling=async_scheduling)
    if spec.startswith("constant:"):
        try:
            return ConstantStepCost(float(spec.split(":", 1)[1]))
        except ValueError as e:
            raise ConfigError(f"bad step cost '{spec}': {e}") from None
    if spec.startswith("measured:"):
        return MeasuredStepCost.from_replay_dir(spec.split(":", 1)[1])
    raise ConfigError(f"unknown step cost '{spec}' (use 'predictor', 'constant:SECONDS' or 'measured:DIR')")
