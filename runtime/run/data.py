"""Training data: records -> token ids -> per-step batches ``[M, B, S]`` with loss labels.

``StepBatches.step(i)`` is a pure function of ``i`` (and the constructor's arguments), so a resumed run, every
stage process and the reference trainer all see the same rows without sharing state:

- packed (``data.packing``, the default): each epoch's records, in an order shuffled by ``(seed, epoch)``, are
  packed into rows of ``seq_len`` tokens by best-fit decreasing (hetero/packing.py), and the rows shuffled again;
  row ``g = i * M * B + j`` of the run is row ``g % R`` of epoch ``g // R`` (``R`` rows per epoch, the same in
  every epoch). Position ids restart at each record, and a record's first token gets no label, so no token
  learns from another record; the stages keep attention inside each record (runtime/stage/attention.py).
- one record per row (``data.packing=false``): sequence ``g`` is record ``perm(seed, epoch)[g % N]`` with
  ``epoch = g // N``, padded on the right.

Labels follow the Hugging Face causal-LM convention: ``labels`` is aligned with ``input_ids`` and
the loss compares ``logits[:, :-1]`` with ``labels[:, 1:]``; ``-100`` marks "no loss here".

Formats (docs/data.md): ``text`` and ``alpaca`` get the tokenizer's BOS and EOS around them, ``tokens``
is used as given, and ``chat`` is exactly what the tokenizer's chat template renders.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetero.errors import ConfigError
from hetero.packing import pack_rows
from hetero.runtime.base.prompts import render_alpaca
from hetero.runtime.run.data_files import (
    _first_line,
    chat_messages,
    held_out_indices,
    read_records,
    text_bound,
    validate_records,
)
from hetero.specs import DataSpec

IGNORE_INDEX = -100
# A text of more than seq_len x this many characters is cut before tokenizing (StepBatches._ids); tokens are rarely
# longer than 16 characters. The cut keeps CUT_MARGIN_TOKENS past seq_len, so the tokens at the cut fall outside the row.
CHARS_PER_TOKEN_CUT, CUT_MARGIN_TOKENS = 64, 64
FORMATS = ("text", "alpaca", "tokens", "chat")

@dataclass
class StepBatch:
    """One optimizer step's global batch, split into M micro-batches of B sequences of S tokens."""

    input_ids: torch.Tensor  # int64 [M, B, S]
    labels: torch.Tensor  # int64 [M, B, S]; -100 where no loss
    num_label_tokens: int  # count of labels[..., 1:] != -100 over the whole step: the loss divisor
    record_ids: list[int]  # dataset index of each record in the step, row-major over (M, B) and along each row
    # Packed rows: each token's position in its record (a record starts where it is 0; the padding after the last
    # record of a row is a segment of its own). None: one record per row, positions 0..S-1.
    position_ids: torch.Tensor | None = None
    num_tokens: int = 0  # record tokens in the step (not padding): what it computes that is not waste



def chat_spans(tokenizer: Any, messages: list[dict[str, Any]], where: str,
               locate: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the tokenizer's chat template renders it, and (with ``locate``) the character
    span of each assistant turn: from the end of the generation prompt before it to the end of the turn as
    the template writes it (its end-of-turn marker and anything the template puts after it included)."""
    # Only role and content reach the template: a Parquet struct column adds null keys of other rows.
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(turns[:upto], tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja errors and the template's own raise_exception(...)
            raise ConfigError(f"{where}: the tokenizer's chat template refuses this conversation: "
                              f"{_first_line(exc)}") from None
        if not isinstance(text, str):
            raise ConfigError(f"{where}: the tokenizer's chat template did not render a string")
        return text

    full = render(len(turns), False)
    found: list[tuple[int, int]] = []
    for i, turn in enumerate(turns):
        if not locate or turn["role"] != "assistant":
            continue
        if i == 0:  # nothing before it to tell where the template's assistant header ends
            raise ConfigError(f"{where}: messages[0] is an assistant turn: start the conversation with a "
                              "system or user message (or set data.train_on_prompt=true)")
        # The template must write the conversation so far the same way whatever follows it, or the
        # assistant turns cannot be located in the whole: refuse rather than mask the wrong tokens.
        before, through = render(i, True), render(i + 1, False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ConfigError(f"{where}: the chat template renders the conversation up to messages[{i}] "
                              "differently once later turns follow, so its assistant turns cannot be "
                              "located; set data.train_on_prompt=true (loss on every token) or pre-tokenize "
                              "(data.format=tokens)")
        found.append((len(before), len(through)))
    return full, found


def cut_ids(tokenizer: Any, text: str, seq_len: int) -> tuple[list[int], bool]:
    """``text``'s tokens, and whether it was cut first: a text far longer than a row can use is tokenized from a
    prefix (a 1 GiB record made the tokenizer take every byte of memory) that still gives more than ``seq_len``
    tokens and a margin, so that what a row keeps is what the whole text gives; its length is then a lower bound."""
    keep = seq_len * CHARS_PER_TOKEN_CUT
    while len(text) > keep:
        ids = tokenizer(text[:keep], add_special_tokens=False)["input_ids"]
        if len(ids) > seq_len + CUT_MARGIN_TOKENS:
            return list(ids), True
        keep *= 4  # tokens longer than the bound assumes: cut further on
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), False


def bounded_messages(messages: list[dict[str, Any]], seq_len: int) -> list[dict[str, Any]]:
    """A conversation with each message longer than a row can use cut to seq_len x CHARS_PER_TOKEN_CUT characters
    (as cut_ids cuts a text); ``messages`` itself when none is."""
    keep = seq_len * CHARS_PER_TOKEN_CUT
    if all(len(m["content"]) <= keep for m in messages):
        return messages
    return [{**m, "content": m["content"][:keep]} for m in messages]


class StepBatches:
    """Deterministic per-step batches: ``step(i)`` depends only on ``i`` and the constructor args."""

    def __init__(
        self,
        data: DataSpec,
        tokenizer_dir: Path,
        seq_len: int,
        micro_batch_size: int,
        num_micro_batches: int,
        seed: int,
        shuffle: bool,
        packing: bool | None = None,
        hold_out: float = 0.0,
    ) -> None:
        """``packing``: several records per row (default: ``data.packing``); ``hold_out``: eval.split, the fraction
        of the records kept out of training for held-out evaluation (data_files.held_out_indices)."""
        if data.format not in FORMATS:
            raise ConfigError(f"data.format '{data.format}': expected one of {list(FORMATS)}")
        for key, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches)):
            if value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
        if seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2 to have a next-token target, got {seq_len}")
        self.data = data
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.num_micro_batches = num_micro_batches
        self.seed = seed
        self.shuffle = shuffle
        self.packing = data.packing if packing is None else packing
        loaded = read_records(data, text_bound(seq_len, CHARS_PER_TOKEN_CUT))
        validate_records(loaded.records, data, loaded.name, loaded.located)
        loaded = loaded.without(held_out_indices(len(loaded.records), hold_out, seed))
        self.records, self.source, self.located = loaded.records, loaded.name, loaded.located
        self._cut_on_reading = loaded.cut  # records whose texts were cut as the file was read

        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except Exception as exc:
            raise ConfigError(f"tokenizer in '{tokenizer_dir}' cannot be loaded: {_first_line(exc)}") from None
        tok = self.tokenizer
        # Rows are cut to seq_len here, after tokenizing: the tokenizer's warning that a record is longer than the
        # model takes ("will result in indexing errors") is not true of hetero's rows.
        tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
        if data.format == "chat" and not getattr(tok, "chat_template", None):
            raise ConfigError(f"data.format=chat: the tokenizer in {tokenizer_dir} has no chat template; use "
                              "data.format=alpaca or text, or a model whose tokenizer has a chat template")
        self.bos_id: int | None = tok.bos_token_id
        self.eos_id: int | None = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id: int = pad if pad is not None else 0
        self._encoded: dict[int, tuple[list[int], list[int]]] = {}
        self.cut_records = 0  # texts cut before tokenizing (_ids): their token counts are lower bounds
        self._perms: OrderedDict[int, list[int]] = OrderedDict()
        self._rows: OrderedDict[int, list[list[int]]] = OrderedDict()
        self._rows_per_epoch: int | None = None

    @property
    def num_records(self) -> int:
        """Records in the data set (one epoch)."""
        return len(self.records)

    @property
    def sequences_per_step(self) -> int:
        """M * B: rows in one optimizer step."""
        return self.num_micro_batches * self.micro_batch_size

    @property
    def rows_per_epoch(self) -> int:
        """Rows one pass over the data takes: the packed rows (as many in every epoch), or one per record."""
        if self._rows_per_epoch is None:
            self._rows_per_epoch = len(self.epoch_rows(0)) if self.packing else self.num_records
        return self._rows_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one epoch (the last one may start the next epoch)."""
        return math.ceil(self.rows_per_epoch / self.sequences_per_step)

    def epoch_of(self, step: int) -> int:
        """The epoch the first row of ``step`` belongs to."""
        return step * self.sequences_per_step // self.rows_per_epoch

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(self.num_records))
            if self.shuffle:
                # A string seed: stable across Python versions and platforms (hashed with sha512).
                random.Random(f"hetero-data:{self.seed}:{epoch}").shuffle(order)
            self._perms[epoch] = order
            if len(self._perms) > 4:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def record_index(self, sample: int) -> int:
        """Dataset index of the run's ``sample``-th sequence (counting across steps and epochs), one record per row."""
        epoch, pos = divmod(sample, self.num_records)
        return self._permutation(epoch)[pos]

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """Packed: the dataset indices of each row of ``epoch``, in the epoch's row order."""
        if epoch not in self._rows:
            order = self._permutation(epoch)
            lengths = [len(self.encode(index)[0]) for index in order]
            rows = [[order[p] for p in row] for row in pack_rows(lengths, self.seq_len)]
            if self.shuffle:  # best fit puts the longest records first: spread them over the epoch's steps
                random.Random(f"hetero-pack:{self.seed}:{epoch}").shuffle(rows)
            self._rows[epoch] = rows
            if len(self._rows) > 4:
                self._rows.popitem(last=False)
        return self._rows[epoch]

    def row_records(self, row: int) -> list[int]:
        """Dataset indices of the records in the run's ``row``-th row (counting across steps and epochs)."""
        if not self.packing:
            return [self.record_index(row)]
        epoch, pos = divmod(row, self.rows_per_epoch)
        return self.epoch_rows(epoch)[pos]

    def encode(self, index: int) -> tuple[list[int], list[int]]:
        """Token ids and labels of record ``index``, before truncation and padding."""
        if index not in self._encoded:
            record, before = self.records[index], self.cut_records
            self._encoded[index] = self._encode_chat(record, index) if self.data.format == "chat" else \
                self._encode(record)
            # A record cut on reading whose cut text still gave too few tokens to be cut again is counted too.
            self.cut_records += index in self._cut_on_reading and self.cut_records == before
        return self._encoded[index]

    def _ids(self, text: str) -> list[int]:
        ids, cut = cut_ids(self.tokenizer, text, self.seq_len)
        self.cut_records += cut
        return ids

    def _encode(self, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        fmt = self.data.format
        if fmt == "tokens":
            ids = list(record["input_ids"])
            labels = list(record["labels"]) if record.get("labels") is not None else list(ids)
            return ids, labels
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        if fmt == "text":
            body = head + self._ids(record[self.data.text_field]) + tail
            return body, list(body)
        # Prompt and response are tokenized separately so the loss mask falls on a token boundary.
        prompt = head + self._ids(render_alpaca(record))
        response = self._ids(record["output"]) + tail
        prompt_labels = list(prompt) if self.data.train_on_prompt else [IGNORE_INDEX] * len(prompt)
        return prompt + response, prompt_labels + response

    def _bounded(self, messages: list[dict[str, Any]], count: bool = True) -> list[dict[str, Any]]:
        kept = bounded_messages(messages, self.seq_len)
        self.cut_records += count and kept is not messages
        return kept

    def _encode_chat(self, record: dict[str, Any], index: int) -> tuple[list[int], list[int]]:
        # One tokenization of the whole rendering (as apply_chat_template(tokenize=True) gives it); a token
        # gets a label when its characters overlap an assistant turn. Tokenizing the pieces apart would
        # split tokens that straddle a boundary, e.g. "Assistant: " + "Hi" -> " Hi".
        text, spans = chat_spans(self.tokenizer, self._bounded(chat_messages(record)),
                                 f"{self.source}: {self.located[index]}", locate=not self.data.train_on_prompt)
        if self.data.train_on_prompt:
            ids = self._ids(text)
            return ids, list(ids)
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # tokenizers without character offsets
            raise ConfigError(f"data.format=chat: the tokenizer in {self.tokenizer.name_or_path} gives no "
                              "character offsets (a slow tokenizer?); use a model with a tokenizer.json, or "
                              "set data.train_on_prompt=true") from None
        ids = list(enc["input_ids"])
        labels = [IGNORE_INDEX] * len(ids)
        for k, (start, end) in enumerate(enc["offset_mapping"]):
            if any(start < span_end and end > span_start for span_start, span_end in spans):
                labels[k] = ids[k]
        return ids, labels

    def check(self, first_step: int, end_step: int, vocab_size: int | None) -> None:
        """Fail before the run starts, not mid-run: token ids fit the model, and every step in
        ``[first_step, end_step)`` has a label token (a step without one would divide its loss by zero), and
        the chat template renders every conversation with findable assistant turns."""
        if self.data.format == "chat":
            for i, r in enumerate(self.records):  # renders text only; tokenizing waits for the record's step
                chat_spans(self.tokenizer, self._bounded(chat_messages(r), count=False),
                           f"{self.source}: {self.located[i]}", locate=not self.data.train_on_prompt)
        if vocab_size is not None and self.data.format == "tokens":
            for i, r in enumerate(self.records):
                bad = next((t for t in r["input_ids"] if t >= vocab_size), None)
                if bad is None and r.get("labels") is not None:
                    bad = next((t for t in r["labels"] if t != IGNORE_INDEX and not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise ConfigError(f"{self.source}: {self.located[i]}: token id {bad} is outside the model's vocabulary "
                                      f"(vocab_size {vocab_size}); tokenize with this model's tokenizer")
        per_step = self.sequences_per_step
        for i in range(first_step, end_step):
            # Usually the step's first record has labels: about one tokenization per step, cached for the run.
            if not any(self._labeled(index) for j in range(per_step) for index in self.row_records(i * per_step + j)):
                self.step(i)  # raises the error a run would hit at this step
        top = max((max(ids, default=0) for ids, _ in self._encoded.values()), default=0)
        if vocab_size is not None and top >= vocab_size:
            raise ConfigError(f"the tokenizer in {self.tokenizer.name_or_path} produces token id {top}, beyond the "
                              f"model's vocab_size {vocab_size}: use the model's own tokenizer")

    def _labeled(self, index: int) -> bool:
        """Whether record ``index`` has a label token after truncation to seq_len (as ``step`` counts them): its
        first token never has one (nothing before it in its record predicts it)."""
        _, labels = self.encode(index)
        return any(t != IGNORE_INDEX for t in labels[1:self.seq_len])

    def step(self, i: int) -> StepBatch:
        """The global batch of optimizer step ``i`` (0-based)."""
        if i < 0:
            raise ValueError(f"step must be >= 0, got {i}")
        m, b, s = self.num_micro_batches, self.micro_batch_size, self.seq_len
        # Right padding: under a causal mask real tokens never attend to the pads that follow them, and pad
        # positions carry label -100. Packed, the pads after a row's last record are a segment of their own.
        input_ids = torch.full((m * b, s), self.pad_id, dtype=torch.long)
        labels = torch.full((m * b, s), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((m * b, s), dtype=torch.long) if self.packing else None
        record_ids: list[int] = []
        num_tokens = 0
        for j in range(m * b):
            at = 0
            for index in self.row_records(i * m * b + j):
                record_ids.append(index)
                ids, labs = self.encode(index)
                n = min(len(ids), s - at)  # truncate longer records (a packed row only holds what fits)
                input_ids[j, at:at + n] = torch.tensor(ids[:n], dtype=torch.long)
                labels[j, at:at + n] = torch.tensor(labs[:n], dtype=torch.long)
                if at:  # nothing before it in its own record predicts its first token (at 0 the shift drops it)
                    labels[j, at] = IGNORE_INDEX
                if positions is not None:
                    positions[j, at:at + n] = torch.arange(n)
                at += n
            num_tokens += at
            if positions is not None and at < s:
                positions[j, at:] = torch.arange(s - at)
        num_label_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
        if num_label_tokens == 0:
            raise ConfigError(
                f"{self.source}: step {i + 1} has no label tokens after truncation to seq_len={s}; raise model.seq_len"
            )
        return StepBatch(input_ids.view(m, b, s), labels.view(m, b, s), num_label_tokens, record_ids,
                         None if positions is None else positions.view(m, b, s), num_tokens)
