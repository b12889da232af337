"""What a replay replays: the job schema and its file format (``traces``), synthetic agents
(``trace_synth``) and SWE-smith trajectories (``swesmith``, ``swesmith_gen``).
"""
