"""Trajectories in the SWE-smith layout, generated: the shipped three-layout sample
(``sample_trajectories`` / ``write_sample``, regenerate with ``python -m scheduling.workload.swesmith_gen``)
and any number of trajectories drawn from a trace preset's statistics (``generate_trajectories``,
``write_trajectories``; ``gpubench trace swesmith``). ``scheduling.workload.swesmith`` reads them back
like the public files.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from scheduling.workload.swesmith import CHARS_PER_TOKEN, MESSAGE_OVERHEAD_TOKENS, SAMPLE_PATH, tool_class

_SYSTEM_PROMPT = (
    "You are a helpful assistant that can interact with a computer to solve tasks.\n"
    "<IMPORTANT>* If user provides a path, you should NOT assume it's relative to the current working "
    "directory. Instead, you should explore the file system to find the file before working on it.\n"
    "</IMPORTANT>\n"
)


def _filler(rng: np.random.Generator, num_chars: int) -> str:
    """Code-like text of about num_chars characters (deterministic for the rng)."""
    words = ["def", "return", "self", "import", "class", "if", "else", "for", "in", "None", "value",
             "config", "path", "test_", "assert", "raise", "Error", "os.path.join", "kwargs", "(", ")", ":"]
    out, size = [], 0
    while size < num_chars:
        w = words[int(rng.integers(len(words)))]
        out.append(w)
        size += len(w) + 1
        if rng.random() < 0.12:
            out.append("\n    ")
    return " ".join(out)[:num_chars]


def _tool_steps(rng: np.random.Generator, num_steps: int) -> list[tuple[str, str]]:
    """(function name, command) pairs an SWE agent plausibly runs."""
    bash_cmds = ["grep -rn 'def parse' src/", "find . -name '*.py' -path '*config*'", "python reproduce.py",
                 "cd /testbed && python -m pytest tests/test_core.py -x -q", "ls -la src/pkg",
                 "git diff", "pip install -e .", "cat setup.cfg"]
    editor_cmds = ["view", "str_replace", "create", "view", "insert"]
    steps = []
    for _ in range(num_steps):
        if rng.random() < 0.5:
            steps.append(("bash", bash_cmds[int(rng.integers(len(bash_cmds)))]))
        else:
            steps.append(("str_replace_editor", editor_cmds[int(rng.integers(len(editor_cmds)))]))
    steps.append(("submit", "submit"))
    return steps


def _sample_messages(layout: str, rng: np.random.Generator, num_steps: int, parts: bool, seed: int) -> list[dict]:
    def content(text: str) -> Any:
        return [{"type": "text", "text": text}] if parts else text

    messages: list[dict] = [
        # One system prompt for every trajectory of a seed: they share a prefix group, as runs of one
        # agent configuration do.
        {"role": "system", "content": content(_SYSTEM_PROMPT + _filler(np.random.default_rng([seed, 99]), 6000)),
         "agent": "main",
         "message_type": "system_prompt"},
        {"role": "user", "content": content("<uploaded_files>/testbed</uploaded_files>\n<pr_description>\n"
                                            + _filler(rng, int(rng.integers(800, 3000))) + "\n</pr_description>"),
         "agent": "main", "message_type": "observation"},
    ]
    for i, (fn, cmd) in enumerate(_tool_steps(rng, num_steps)):
        thought = _filler(rng, int(rng.integers(150, 900)))
        obs = _filler(rng, int(min(20000, rng.lognormal(math.log(1200), 1.0))))
        if layout == "tool":
            args = {"command": cmd} if fn != "submit" else {}
            if fn == "str_replace_editor":
                args["path"] = "/testbed/src/pkg/core.py"
            messages.append({"role": "assistant", "content": content(thought), "agent": "main",
                             "message_type": "action", "tool_calls": [{
                                 "id": f"call_{i}", "type": "function",
                                 "function": {"name": fn, "arguments": json.dumps(args)}}]})
            messages.append({"role": "tool", "content": content("OBSERVATION:\n" + obs), "tool_call_id": f"call_{i}",
                             "agent": "main", "message_type": "observation"})
        elif layout == "ticks":
            command = cmd if fn != "str_replace_editor" else f"str_replace_editor {cmd} /testbed/src/pkg/core.py"
            messages.append({"role": "assistant", "content": content(f"THOUGHT: {thought}\n\n```bash\n{command}\n```"),
                             "agent": "main", "message_type": "action"})
            messages.append({"role": "user", "content": content("OBSERVATION:\n" + obs), "agent": "main",
                             "message_type": "observation"})
        elif layout == "xml":
            param = f"<parameter=command>{cmd}</parameter>" if fn != "submit" else ""
            messages.append({"role": "assistant", "content": content(f"{thought}\n\n<function={fn}>\n{param}\n</function>"),
                             "agent": "main", "message_type": "action"})
            messages.append({"role": "user", "content": content("OBSERVATION:\n" + obs), "agent": "main",
                             "message_type": "observation"})
        else:
            raise ValueError(f"unknown layout {layout!r}")
    return messages


def sample_trajectories(seed: int = 0) -> list[dict]:
    """Rows in the SWE-smith layout: two trajectories per layout (tool, ticks, xml), string and
    list-of-parts content, 7-30 turns each. Deterministic for the seed."""
    rows = []
    for layout in ("tool", "ticks", "xml"):
        for variant in range(2):
            rng = np.random.default_rng([seed, ("tool", "ticks", "xml").index(layout), variant])
            num_steps = int(rng.integers(6, 30))
            instance = f"sample__repo.{layout}{variant}__func_pm_remove_cond__{seed}"
            rows.append({
                "messages": json.dumps(_sample_messages(layout, rng, num_steps, parts=bool(variant), seed=seed)),
                "instance_id": instance, "resolved": bool(variant), "model": f"sample-{layout}",
                "traj_id": f"{instance}.{layout}", "patch": "diff --git a/src/pkg/core.py b/src/pkg/core.py\n",
            })
    return rows


# A command an agent of each duration class plausibly runs, per layout's way of spelling it.
_CLASS_COMMANDS: dict[str, tuple[str, str]] = {
    # class: (function name, command)
    "view": ("str_replace_editor", "view /testbed/src/pkg/core.py"),
    "search": ("bash", "grep -rn 'def parse' src/"),
    "edit": ("str_replace_editor", "str_replace /testbed/src/pkg/core.py"),
    "bash": ("bash", "./run_checks.sh"),
    "test": ("bash", "pytest tests/test_core.py -x -q"),
    "python": ("bash", "python reproduce.py"),
    "submit": ("submit", ""),
}


def _chars_for(num_tokens: int, *, taken: int = 0) -> int:
    """Characters of filler that make a message of ``num_tokens`` under the estimate, given
    ``taken`` characters already in it (the message's own markup)."""
    return max(1, int(CHARS_PER_TOKEN * max(1, num_tokens - MESSAGE_OVERHEAD_TOKENS)) - taken)


def _assistant_message(layout: str, tool_class_name: str | None, num_tokens: int, rng: np.random.Generator,
                       call_id: str, content: Callable[[str], Any]) -> dict:
    if tool_class_name is None:  # the last turn: a final answer, no call
        return {"role": "assistant", "content": content(_filler(rng, _chars_for(num_tokens))), "message_type": "action"}
    fn, command = _CLASS_COMMANDS[tool_class_name]
    if layout == "tool":
        args = json.dumps({"command": command} if command else {})
        return {"role": "assistant", "content": content(_filler(rng, _chars_for(num_tokens, taken=len(args)))),
                "message_type": "action",
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": fn, "arguments": args}}]}
    if layout == "ticks":
        call = f"\n\n```bash\n{command or fn}\n```"
    else:  # xml
        param = f"<parameter=command>{command}</parameter>" if command else ""
        call = f"\n\n<function={fn}>\n{param}\n</function>"
    return {"role": "assistant", "content": content(_filler(rng, _chars_for(num_tokens, taken=len(call))) + call),
            "message_type": "action"}


def generate_trajectories(num_jobs: int, seed: int = 0, params=None) -> Iterator[dict]:
    """``num_jobs`` rows in the SWE-smith layout whose lengths follow the synthetic agent.

    Each row renders one job of ``synthetic_jobs(num_jobs, seed, params)`` (default: the agent
    calibrated to public SWE-smith statistics) as a conversation: a system prompt shared by the
    job's prefix group, the task, then per turn an assistant message (its text and tool call as
    long as the turn's output under the ``estimate`` token count) and the observation (as long as
    the next turn's input). Layouts cycle tool, ticks, xml; odd rows use list-of-parts content. The
    tool call names a command of the turn's duration class, so loading the file draws tool times
    from the same models. Message text is filler: only lengths, roles and calls are real.
    """
    from scheduling.workload.trace_synth import synthetic_jobs

    jobs = synthetic_jobs(num_jobs, seed, params, id_prefix="swesmith")
    system_texts: dict[str, str] = {}
    for i, job in enumerate(jobs):
        layout = ("tool", "ticks", "xml")[i % 3]
        parts = bool(i % 2)

        def content(text: str, parts=parts) -> Any:
            return [{"type": "text", "text": text}] if parts else text

        rng = np.random.default_rng([int(seed), 7, i])
        if job.prefix_group not in system_texts:
            group_rng = np.random.default_rng([int(seed), 8, len(system_texts)])
            system_texts[job.prefix_group] = _SYSTEM_PROMPT + _filler(
                group_rng, _chars_for(job.system_tokens, taken=len(_SYSTEM_PROMPT)))
        messages: list[dict] = [{"role": "system", "content": content(system_texts[job.prefix_group]),
                                 "message_type": "system_prompt"}]
        for k, turn in enumerate(job.turns):
            if turn.input_tokens > MESSAGE_OVERHEAD_TOKENS:
                role = "tool" if layout == "tool" and k > 0 else "user"
                obs = {"role": role, "content": content(_filler(rng, _chars_for(turn.input_tokens))),
                       "message_type": "observation"}
                if role == "tool":
                    obs["tool_call_id"] = f"call_{k - 1}"
                messages.append(obs)
            messages.append(_assistant_message(layout, None if turn.tool is None else tool_class(turn.tool),
                                               turn.output_tokens, rng, f"call_{k}", content))
        instance = f"synthetic__repo.{i:05d}__seed{seed}"
        yield {"messages": json.dumps(messages), "instance_id": instance, "resolved": bool(rng.random() < 0.5),
               "model": f"synthetic-{layout}", "traj_id": f"{instance}.{layout}", "patch": ""}


def write_trajectories(path: str | Path, rows: Iterable[dict]) -> Path:
    """Write rows as JSONL, or parquet for a ``.parquet`` path, atomically (a temporary file, then
    a rename), so an interrupted write never leaves a partial file behind."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.suffix == ".parquet":
            import pandas as pd

            pd.DataFrame(list(rows)).to_parquet(tmp, index=False)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # name the file asked for (a full disk's error names none)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_sample(path: str | Path = SAMPLE_PATH, seed: int = 0) -> Path:
    """(Re)generate the shipped sample file (JSONL; ``.parquet`` suffix writes parquet)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = sample_trajectories(seed)
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path, index=False)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return path


if __name__ == "__main__":  # python -m scheduling.workload.swesmith_gen  -> regenerate the shipped sample
    print(write_sample())
