"""What is built on the engine: replays (``replay``, live through vLLM in ``live``), sweeps
(``sweep``, ``sweep_table``, ``sweep_report``, ``sweep_defaults``, ``saturation``), their metrics,
comparisons of two replays (``compare``) and the differential test against vLLM's scheduler (``vllm_diff``).
"""
