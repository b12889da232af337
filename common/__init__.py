"""The bottom floor: what every stage shares and nothing of a stage.

Errors that end in one clear line (``errors``), the one JSON/JSONL reader (``jsonio``), locked output
directories and atomic writes (``outdir``), the Markdown table writer (``mdtable``), median and
spread (``stats``), argparse value types and help formatting (``argtypes``, ``clihelp``), child
process helpers (``procutil``), and the model architecture configs every stage reads
(``model_config``, shipped in ``model_configs/``). Nothing here imports a pipeline package.
"""
