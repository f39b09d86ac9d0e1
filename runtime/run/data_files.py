"""Training data files: reading JSON Lines, JSON and Parquet records, bounded, and checking them against
``data.format`` (docs/data.md), with a hint where a record looks like another format.

Nothing here tokenizes: `hetero compile` checks a data file with it before it plans (an explicit ``data.path`` that
cannot be used is an error there, not at the run's first step), and runtime/run/data.py encodes what it returns.
A file's JSON is bounded: a value nested deeper than MAX_JSON_DEPTH or a number longer than MAX_NUMBER_DIGITS is
refused in one line naming its line (Python's own parser fails on them with a traceback or a long wait).
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError
from hetero.serde import short_repr
from hetero.specs import DataSpec

CHAT_ROLES = ("system", "user", "assistant")
DEMO_NAME = "<bundled demo_alpaca.jsonl>"
MAX_NUMBER_DIGITS = 100  # token ids and counts fit in 20; nothing in a record needs more
MAX_JSON_DEPTH = 64  # a chat record nests 3 deep (record, messages, message)
# ShareGPT's `conversations` [{from, value}] as chat messages: its speakers' names for hetero's roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def held_out_indices(count: int, split: float, seed: int) -> list[int]:
    """Which of ``count`` records eval.split holds out of training, in file order: ``round(count * split)`` of them
    (at least one, never all), picked by the run's seed, the same in every process that reads the data."""
    import random

    if split <= 0 or count < 2:
        return []
    size = min(count - 1, max(1, round(count * split)))
    return sorted(random.Random(f"hetero-eval-split:{seed}:{count}").sample(range(count), size))


class JsonLimitError(ValueError):
    """A JSON value past MAX_JSON_DEPTH or with a number past MAX_NUMBER_DIGITS."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise JsonLimitError(f"a number of {len(text.lstrip('-')):,} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _depth(value: Any) -> int:
    """How deep ``value`` nests (1: a scalar), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            todo += [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, level + 1) for v in item]
    return deepest


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` within hetero's bounds (JsonLimitError past them; json.JSONDecodeError as json raises it)."""
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_float=_bounded_float)
    except RecursionError:
        raise JsonLimitError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise JsonLimitError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _bounded_float(text: str) -> float:
    digits = sum(c.isdigit() for c in text)
    if digits > MAX_NUMBER_DIGITS:
        raise JsonLimitError(f"a number of {digits:,} digits (at most {MAX_NUMBER_DIGITS})")
    return float(text)


def load_records(data: DataSpec) -> tuple[list[dict[str, Any]], str]:
    """The raw records of ``data`` and a display name for error messages."""
    records, name, _ = load_located(data)
    return records, name


def text_bound(seq_len: int, chars_per_token: int) -> int:
    """The characters of one text worth keeping for rows of ``seq_len`` tokens: ``chars_per_token`` (where
    runtime/run/data.py's cut_ids starts) grown 64-fold, three of its widenings."""
    return seq_len * chars_per_token * 64


def bounded(record: dict[str, Any], max_chars: int) -> tuple[dict[str, Any], bool]:
    """``record`` with every text (and list) in it longer than ``max_chars`` cut to that length, and whether any
    was; ``record`` itself when none is (what the file holds past the cut is never tokenized)."""
    def cut(value: Any) -> Any:
        if isinstance(value, (str, list)) and len(value) > max_chars:
            value = value[:max_chars]
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    def longest(value: Any) -> int:
        if isinstance(value, dict):
            return max((longest(v) for v in value.values()), default=0)
        if isinstance(value, list):
            return max([len(value), *(longest(v) for v in value)])
        return len(value) if isinstance(value, str) else 0

    if longest(record) <= max_chars:
        return record, False
    return cut(record), True


@dataclass
class Loaded:
    """A data file's records (cut to ``max_chars`` where given), its name for messages, where each record is
    (``line N`` / ``record N``), and which records were cut on reading."""

    records: list[dict[str, Any]]
    name: str
    located: list[str]
    cut: set[int] = field(default_factory=set)

    def cut_to(self, max_chars: int | None) -> Loaded:
        """These records, each cut to ``max_chars`` (``bounded``): for a file read whole (JSON lines are cut as they
        are read)."""
        if max_chars is not None:
            for i, record in enumerate(self.records):
                self.records[i], was_cut = bounded(record, max_chars)
                if was_cut:
                    self.cut.add(i)
        return self

    def without(self, indices: list[int]) -> Loaded:
        """These records without those at ``indices`` (eval.split's held-out ones); itself when there are none."""
        if not indices:
            return self
        gone = set(indices)
        kept = [i for i in range(len(self.records)) if i not in gone]
        return Loaded([self.records[i] for i in kept], self.name, [self.located[i] for i in kept],
                      {new for new, old in enumerate(kept) if old in self.cut})


def load_located(data: DataSpec, max_chars: int | None = None) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The raw records of ``data``, a display name for error messages, and where each record is in the file:
    ``line N`` for JSON lines, ``record N`` (from 1) for a JSON array or Parquet (read_records, without which
    records were cut)."""
    loaded = read_records(data, max_chars)
    return loaded.records, loaded.name, loaded.located


def read_records(data: DataSpec, max_chars: int | None = None) -> Loaded:
    """The records of ``data``: JSON is read by hetero itself, line by line: every value stays as the file has it
    (no column types inferred across records, which turned a valid "5" into 5 and blamed another record), and a
    bad line is named. With ``max_chars``, each record is cut (``bounded``) as it is read: a 1 GiB record costs
    its line and its parsed text while it is read (twice its size), then only what a row can use."""
    return _read(data, max_chars)


def _read(data: DataSpec, max_chars: int | None) -> Loaded:
    if data.path is None:
        if data.format != "alpaca":
            raise ConfigError(f"data.format={data.format} needs data.path=FILE: the bundled demo set "
                              "(used when data.path is unset) is in the alpaca format")
        from hetero.runtime.pretrained import demo_data_text

        text = demo_data_text()
        if text.lstrip().startswith("["):
            return _read_array(text, DEMO_NAME).cut_to(max_chars)
        return _parse_jsonl(enumerate(_lines(text), 1), DEMO_NAME, max_chars)
    path = Path(data.path).expanduser()
    name = str(path)
    if not path.is_file():
        raise ConfigError(f"data.path '{name}': no such file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise ConfigError(f"data.path '{name}': unsupported file type '{suffix}'; use .jsonl, .json or .parquet")
    if path.stat().st_size == 0:
        raise ConfigError(f"data.path '{name}': file is empty")
    if suffix == ".parquet":
        records = _read_parquet(path, name)
        return Loaded(records, name, [f"record {i}" for i in range(1, len(records) + 1)]).cut_to(max_chars)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
        first = re.search(rb"\S", view)
        if first is not None and view[first.start()] == ord("["):
            return _read_array(_decoded(view, 0, len(view), name), name).cut_to(max_chars)
        return _parse_jsonl(_file_lines(mm, view, name), name, max_chars)


def _decoded(view: memoryview, start: int, end: int, name: str) -> str:
    """Bytes ``start:end`` of a mapped file as text, with no copy of the bytes (a 1 GiB line costs its text only)."""
    try:
        return str(view[start:end], "utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"data.path '{name}': not UTF-8 text (byte {start + exc.start}): save it as UTF-8") from None


def _file_lines(mm: mmap.mmap, view: memoryview, name: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line of a mapped JSON Lines file, one at a time."""
    start, lineno = 0, 0
    while start < len(mm):
        end = mm.find(b"\n", start)
        end = len(mm) if end < 0 else end
        lineno += 1
        yield lineno, _decoded(view, start, end, name)
        start = end + 1


def _read_parquet(path: Path, name: str) -> list[dict[str, Any]]:
    import tempfile

    import datasets

    # Stage logs are line-oriented: no "Generating train split" bars (restored afterwards).
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        # A private, throwaway Arrow cache: several stage processes read the same file at once, and
        # the records are materialized below anyway.
        with tempfile.TemporaryDirectory(prefix="hetero-data-") as cache_dir:
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache_dir)
            records = ds.to_list()
    except Exception as exc:  # datasets wraps parse errors in several types; all mean "bad file"
        raise ConfigError(f"data.path '{name}': cannot read as parquet: {_first_line(exc)}") from None
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    if not records:
        raise ConfigError(f"data.path '{name}': no records")
    return records


def _read_array(text: str, name: str) -> Loaded:
    """One JSON array of objects (a .json file may also hold JSON lines)."""
    try:
        whole = parse_json(text)
    except JsonLimitError as exc:
        long_number = re.search(rf"\d{{{MAX_NUMBER_DIGITS + 1},}}", text)
        at = f"line {text.count(chr(10), 0, long_number.start()) + 1}: " if long_number and "digits" in str(exc) else ""
        raise ConfigError(f"{name}: {at}{exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: line {exc.lineno}: invalid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(whole, list):
        raise ConfigError(f"{name}: expected a JSON array of objects or one JSON object per line")
    for i, record in enumerate(whole, 1):
        if not isinstance(record, dict):
            raise ConfigError(f"{name}: record {i}: expected a JSON object, got {short_repr(record)}")
    if not whole:
        raise ConfigError(f"{name}: no records")
    return Loaded(whole, name, [f"record {i}" for i in range(1, len(whole) + 1)])


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` one at a time (JSON Lines ends each with \\n; a \\r before it is JSON whitespace): a
    list of them all would hold a second copy of the file."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end + 1


def _parse_jsonl(lines: Iterator[tuple[int, str]], name: str, max_chars: int | None) -> Loaded:
    """One JSON object per line (blank lines skipped): the records, each cut to ``max_chars`` as it is read."""
    loaded = Loaded([], name, [])
    for lineno, line in lines:
        if not line or line.isspace():  # (strip() would copy a long line)
            continue
        try:
            record = parse_json(line)
        except JsonLimitError as exc:
            raise ConfigError(f"{name}: line {lineno}: {exc}") from None
        except json.JSONDecodeError as exc:
            short = exc.msg.startswith("Unterminated") or exc.pos >= len(line.rstrip())  # it ends mid-value
            cut = " (the line is cut short?)" if short else ""
            raise ConfigError(f"{name}: line {lineno}: invalid JSON ({exc.msg}, column {exc.colno}){cut}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{name}: line {lineno}: expected a JSON object, got {short_repr(record)}")
        del line  # before the next line is read: one long line in memory at a time
        if max_chars is not None:
            record, was_cut = bounded(record, max_chars)
            if was_cut:
                loaded.cut.add(len(loaded.records))
        loaded.records.append(record)
        loaded.located.append(f"line {lineno}")
    if not loaded.records:
        raise ConfigError(f"{name}: no records")
    return loaded


def validate_records(records: list[dict[str, Any]], data: DataSpec, name: str,
                     located: list[str] | None = None) -> None:
    """Fail at startup, not mid-run, on a record the chosen format cannot use; ``located``: where each record is in
    the file (``line 3``), else ``record N`` from 1. Where the record looks like another format, the error says
    which setting reads it."""
    for i, r in enumerate(records):
        where = f"{name}: {located[i] if located is not None else f'record {i + 1}'}"
        try:
            _validate_one(r, data, where)
        except ConfigError as exc:
            raise ConfigError(f"{exc}{format_hint(r, data)}") from None


def format_hint(record: dict[str, Any], data: DataSpec) -> str:
    """``; this file has 'messages': use data.format=chat`` where ``record`` looks like another format, else ''."""
    if "chosen" in record and "rejected" in record:
        return ("; this file holds preference pairs ('chosen', 'rejected'): hetero trains supervised records "
                "(data.format=chat, alpaca, text or tokens)")
    for key, fmt in (("messages", "chat"), ("conversations", "chat"), ("instruction", "alpaca"),
                     ("input_ids", "tokens")):
        if key in record and fmt != data.format:
            return f"; this file has '{key}': use data.format={fmt}"
    if data.format != "text" and isinstance(record.get("text"), str):
        return "; this file has 'text': use data.format=text"
    if data.format == "text":
        strings = [k for k, v in record.items() if isinstance(v, str)]
        if data.text_field not in record and len(strings) == 1:
            return f"; its one text field is '{strings[0]}': use data.text_field={strings[0]}"
    return ""


def chat_messages(record: dict[str, Any]) -> Any:
    """A chat record's messages: ``messages``, or ShareGPT's ``conversations`` of {from, value} as {role, content}
    (its speakers' other names kept, for the check to name)."""
    if "messages" in record or not isinstance(record.get("conversations"), list):
        return record.get("messages")
    return [{"role": SHAREGPT_ROLES.get(str(turn.get("from")), turn.get("from")), "content": turn.get("value")}
            if isinstance(turn, dict) else turn for turn in record["conversations"]]


def _validate_one(r: dict[str, Any], data: DataSpec, where: str) -> None:
    if data.format == "text":
        if not isinstance(r.get(data.text_field), str):
            raise ConfigError(f"{where}: needs a string field '{data.text_field}' (data.text_field)"
                              + _got(r, data.text_field))
    elif data.format == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(r.get(key), str):
                raise ConfigError(f"{where}: alpaca format needs string fields 'instruction' and 'output' "
                                  + (f"(missing '{key}')" if key not in r else f"('{key}'{_got(r, key)})"))
        if r.get("input") is not None and not isinstance(r["input"], str):
            raise ConfigError(f"{where}: alpaca field 'input' must be a string{_got(r, 'input')}")
    elif data.format == "chat":
        _validate_chat(chat_messages(r), where, "messages" if "messages" in r or "conversations" not in r
                       else "conversations")
    else:
        ids = r.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ConfigError(f"{where}: tokens format needs a non-empty list of non-negative ints 'input_ids'")
        labels = r.get("labels")
        if labels is not None and (
            not isinstance(labels, list) or len(labels) != len(ids) or not all(isinstance(t, int) for t in labels)
        ):
            raise ConfigError(f"{where}: 'labels' must be a list of ints as long as 'input_ids' (-100 = no loss)")


def _got(record: dict[str, Any], key: str) -> str:
    """``, got 3 (a number)`` for a field of the wrong type ('' when it is missing)."""
    if key not in record:
        return ""
    value = record[key]
    kind = {bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)
    return f", got {short_repr(value)} ({kind})"


def _validate_chat(messages: Any, where: str, field: str = "messages") -> None:
    """``field``: what the file calls the turns (ShareGPT's ``conversations`` of {from, value})."""
    role, content = ("from", "value") if field == "conversations" else ("role", "content")
    roles = ", ".join(SHAREGPT_ROLES if field == "conversations" else CHAT_ROLES)
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: chat format needs a non-empty list 'messages' of {{role, content}} "
                          f"objects (or ShareGPT's 'conversations'), got {short_repr(messages)}")
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{where}: {field}[{j}] must be an object with '{role}' and '{content}', "
                              f"got {short_repr(message)}")
        if message.get("role") not in CHAT_ROLES:
            raise ConfigError(f"{where}: {field}[{j}].{role} must be one of {roles}, "
                              f"got {short_repr(message.get('role'))}")
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}: {field}[{j}].{content} must be a string, "
                              f"got {short_repr(message.get('content'))}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: '{field}' has no assistant turn; the chat format learns the "
                          "assistant's replies")
