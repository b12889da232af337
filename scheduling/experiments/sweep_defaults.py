"""The default sweep grid: constants only, so that `gpubench sweep --help` imports nothing heavy."""

# cpu-offload three times: vLLM's default 8 GiB host pool, an undersized-for-the-study 16 GiB one
# and a large 128 GiB one (the pool sizes the published offload findings compare).
DEFAULT_POLICIES = ("fcfs", "continuum", "cpu-offload", "cpu-offload@cpu_gib=16", "cpu-offload@cpu_gib=128",
                    "continuum-offload@cpu_gib=128", "lmcache")
DEFAULT_SKUS = ("a100-40", "a100-80", "h100-sxm", "h200", "l40s", "b200")
# See docs/sweep.md ("Choosing the JPS levels") for how these span light load to overload.
DEFAULT_JPS = (0.5, 1.0, 3.0, 5.0, 10.0)
DEFAULT_SEEDS = (0,)
DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_NUM_JOBS = 400
