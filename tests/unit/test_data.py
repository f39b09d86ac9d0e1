"""StepBatches: formats, loss masks, padding/truncation, deterministic epoch order, bad data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from hetero.errors import ConfigError
from hetero.runtime.base.prompts import render_alpaca
from hetero.runtime.pretrained import demo_data_text
from hetero.runtime.run.data import IGNORE_INDEX, StepBatches
from hetero.runtime.tools.evaluator import held_out_batches
from hetero.specs import DataSpec, EvalSpec, ModelSpec, TrainSpec

REPO = Path(__file__).resolve().parents[2]
DEMO = [json.loads(line) for line in demo_data_text().splitlines() if line.strip()]


def _batches(model_dir: Path, data: DataSpec | None = None, **kw) -> StepBatches:
    # One record per row (data.packing=false): packed rows are tests/e2e/test_packing.py's
    args = {"seq_len": 128, "micro_batch_size": 4, "num_micro_batches": 3, "seed": 0, "shuffle": True,
            "packing": False} | kw
    return StepBatches(data or DataSpec(), model_dir, **args)


def test_demo_file_is_what_the_script_writes() -> None:
    assert len(DEMO) >= 250
    script = REPO / "scripts" / "make_demo_data.py"
    assert subprocess.run([sys.executable, str(script), "--check"]).returncode == 0


def test_alpaca_masks_the_prompt(tiny_model_dir: Path) -> None:
    sb = _batches(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = sb.step(2)
    m, b, s = 3, 4, 128
    assert batch.input_ids.shape == batch.labels.shape == (m, b, s)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.long
    ids, labels = batch.input_ids.view(m * b, s), batch.labels.view(m * b, s)
    for row, index in enumerate(batch.record_ids):
        record = sb.records[index]
        real = ids[row] != tok.pad_token_id
        n = int(real.sum())
        assert bool(real[:n].all()) and not bool(real[n:].any())  # right padding
        assert ids[row, 0] == tok.bos_token_id and ids[row, n - 1] == tok.eos_token_id
        assert tok.decode(ids[row, 1 : n - 1]) == render_alpaca(record) + record["output"]
        target = labels[row] != IGNORE_INDEX
        # Loss exactly on the response and EOS: the prompt and the pads carry -100.
        assert tok.decode(labels[row][target]) == record["output"] + tok.eos_token
        assert torch.equal(labels[row][target], ids[row][target])
        assert bool(target[: n - int(target.sum())].logical_not().all()) and not bool(target[n:].any())
    assert batch.num_label_tokens == int((batch.labels[..., 1:] != IGNORE_INDEX).sum())


def test_train_on_prompt_labels_everything_but_pads(tiny_model_dir: Path) -> None:
    batch = _batches(tiny_model_dir, DataSpec(train_on_prompt=True)).step(0)
    real = batch.input_ids != 0
    assert torch.equal(batch.labels[real], batch.input_ids[real])
    assert bool((batch.labels[~real] == IGNORE_INDEX).all())


def test_order_is_a_pure_function_of_step(tiny_model_dir: Path) -> None:
    a, b = _batches(tiny_model_dir), _batches(tiny_model_dir)
    late = b.step(40)  # a fresh instance asked out of order gives the same batch
    for i in (0, 1, 40):
        x, y = a.step(i), (late if i == 40 else b.step(i))
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert x.record_ids == y.record_ids and x.num_label_tokens == y.num_label_tokens
    n = a.num_records
    epoch0 = [a.record_index(g) for g in range(n)]
    epoch1 = [a.record_index(g) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # each record once per epoch
    assert epoch0 != epoch1 and epoch0 != list(range(n))  # reshuffled each epoch
    # Steps straddling the epoch boundary wrap around: samples g = 12*i + j.
    step = a.step(n // 12)
    assert step.record_ids == [a.record_index(12 * (n // 12) + j) for j in range(12)]
    assert _batches(tiny_model_dir, seed=1).step(0).record_ids != a.step(0).record_ids
    plain = _batches(tiny_model_dir, shuffle=False)
    assert [plain.record_index(g) for g in range(n + 5)] == list(range(n)) + list(range(5))


def test_truncation_and_no_label_steps(tiny_model_dir: Path) -> None:
    full = _batches(tiny_model_dir, shuffle=False).step(0)
    short = _batches(tiny_model_dir, shuffle=False, seq_len=24).step(0)
    assert short.input_ids.shape[-1] == 24
    assert torch.equal(short.input_ids, full.input_ids[..., :24])
    assert torch.equal(short.labels, full.labels[..., :24])
    with pytest.raises(ConfigError, match="no label tokens"):
        _batches(tiny_model_dir, seq_len=4).step(0)


def test_text_format_from_jsonl_and_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [{"body": f"note number {i}: the pipeline is warm"} for i in range(5)]
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    as_json = tmp_path / "notes.json"
    as_json.write_text(json.dumps(rows))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = DataSpec(path=str(jsonl), format="text", text_field="body")
    for path in (jsonl, as_json):
        sb = _batches(tiny_model_dir, DataSpec(path=str(path), format="text", text_field="body"), shuffle=False,
                      micro_batch_size=1, num_micro_batches=2)
        batch = sb.step(0)
        for mb in range(2):
            real = batch.input_ids[mb, 0] != tok.pad_token_id
            assert tok.decode(batch.input_ids[mb, 0][real], skip_special_tokens=True) == rows[mb]["body"]
            assert torch.equal(batch.labels[mb, 0][real], batch.input_ids[mb, 0][real])
    assert _batches(tiny_model_dir, spec, shuffle=False).num_records == 5


def test_tokens_format_from_parquet(tiny_model_dir: Path, tmp_path: Path) -> None:
    import datasets

    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10, 11, 12, 13, 14, 15, 16], "labels": None},  # no labels: every token; truncated
    ]
    path = tmp_path / "tok.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    sb = _batches(tiny_model_dir, DataSpec(path=str(path), format="tokens"), shuffle=False, seq_len=6,
                  micro_batch_size=2, num_micro_batches=1)
    batch = sb.step(0)
    assert batch.input_ids[0].tolist() == [[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]]
    assert batch.labels[0].tolist() == [[-100, -100, 7, 8, -100, -100], [9, 10, 11, 12, 13, 14]]
    assert batch.num_label_tokens == 2 + 5


@pytest.mark.parametrize(
    "content,fmt,match",
    [
        ('{"instruction": "x"}\n', "alpaca", r"line 1: .*\(missing 'output'\)$"),
        # The valid "5" stays a string (no column types inferred across records), and the bad line is the one named.
        ('{"instruction": "a", "output": "5"}\n\n{"instruction": "x", "output": 3}\n', "alpaca",
         r"bad.jsonl: line 3: alpaca format needs string fields 'instruction' and 'output' \('output', got 3 \(a "
         r"number\)\)$"),
        ('{"text": "hi"}\n{"other": "no"}\n', "text", "line 2: needs a string field 'text'"),
        ('{"input_ids": []}\n', "tokens", "line 1: tokens format"),
        ('{"input_ids": [1, 2], "labels": [1]}\n', "tokens", "as long as"),
        ('{"text": "hi"}\n', "chat", "line 1: chat format needs a non-empty list 'messages'"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}\n', "chat",
         r"line 1: messages\[1\]\.role must be one of system, user, assistant, got 'tool'"),
        ('{"messages": [{"role": "user", "content": 3}]}\n', "chat",
         r"messages\[0\]\.content must be a string"),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n', "chat",
         "line 1: 'messages' has no assistant turn"),
        ("", "alpaca", "empty"),
        ("{not json\n", "alpaca", r"bad.jsonl: line 1: invalid JSON \(Expecting property name enclosed in double "
                                   r"quotes, column 2\)$"),
        ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "outp', "alpaca",
         r"line 2: invalid JSON \(Unterminated string starting at, column 22\) \(the line is cut short\?\)$"),
        ('[{"instruction": "a", "output": "b"}, {"instruction": 1, "output": "b"}]', "alpaca",
         r"record 2: alpaca format needs .*\('instruction', got 1 \(a number\)\)$"),
        # A file of another format says which setting reads it (issue 53).
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n', "alpaca",
         r"line 1: alpaca format .*\(missing 'instruction'\); this file has 'messages': use data.format=chat$"),
        ('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}\n', "alpaca",
         r"this file has 'conversations': use data.format=chat$"),
        ('{"instruction": "a", "output": "b"}\n', "chat", r"this file has 'instruction': use data.format=alpaca$"),
        ('{"body": "a"}\n', "text", r"needs a string field 'text' .*use data.text_field=body$"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n', "alpaca", r"this file holds preference pairs"),
        ('{"conversations": [{"from": "human", "value": "a"}, {"from": "tool", "value": "b"}]}\n', "chat",
         r"line 1: conversations\[1\]\.from must be one of system, human, user, gpt, assistant, got 'tool'$"),
        # Bounded JSON: Python's parser gives a traceback on both.
        ('{"text": "a"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "text",
         r"bad.jsonl: line 2: JSON nested deeper than 64 levels$"),
        ('{"text": "a", "id": ' + "1" * 100_000 + "}\n", "text", r"line 1: a number of 100,000 digits \(at most 100\)$"),
        ('[{"text": "a"},\n {"text": "b", "id": ' + "1" * 100_000 + "}]", "text",
         r"bad.jsonl: line 2: a number of 100,000 digits"),
    ],
)
def test_bad_data(tiny_model_dir: Path, tmp_path: Path, content: str, fmt: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        _batches(tiny_model_dir, DataSpec(path=str(path), format=fmt))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_a_huge_record_is_cut_before_it_is_tokenized(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A record of ~1.6 M characters at seq_len 32 (issue 53: a 1 GiB one made the tokenizer take all memory): the
    text is cut before tokenizing, and the row holds exactly the first tokens of the whole text."""
    words = " ".join(f"word{i % 997} and more {i}" for i in range(80_000))
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"text": words}) + "\n" + json.dumps({"text": "a short one"}) + "\n")
    sb = _batches(tiny_model_dir, DataSpec(path=str(path), format="text"), seq_len=32, shuffle=False,
                  micro_batch_size=1, num_micro_batches=1, packing=False)
    ids, _ = sb.encode(0)
    assert sb.cut_records == 1 and 32 < len(ids) < len(words) // 8
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    whole = [tok.bos_token_id, *tok(words, add_special_tokens=False)["input_ids"]]
    assert sb.step(0).input_ids.flatten().tolist() == whole[:32]
    sb.encode(1)
    assert sb.cut_records == 1  # the short one is not cut


def test_a_long_line_is_read_at_twice_its_size_and_kept_cut(tmp_path: Path) -> None:
    """Issue 53: a 1 GiB record must compile and run under a 4 GB memory cap. Reading a long line costs its text and
    its parsed value (about twice its size; the whole-file read held the file, the line and the value), and the
    record kept is cut to what rows of seq_len tokens can use (bench-free: Python's own allocations, by tracemalloc)."""
    import tracemalloc

    from hetero.runtime.run.data import CHARS_PER_TOKEN_CUT
    from hetero.runtime.run.data_files import read_records, text_bound

    size = 40 * 2**20
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"instruction": "go on", "output": "ab " * (size // 3)}) + "\n"
                    + json.dumps({"instruction": "short", "output": "c"}) + "\n")
    bound = text_bound(32, CHARS_PER_TOKEN_CUT)
    tracemalloc.start()
    try:
        loaded = read_records(DataSpec(path=str(path)), bound)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2.4 * size, f"reading a {size >> 20} MiB line peaked at {peak / size:.2f}x its size"
    assert len(loaded.records[0]["output"]) == bound and loaded.records[0]["instruction"] == "go on"
    assert loaded.cut == {0} and loaded.records[1] == {"instruction": "short", "output": "c"}
    assert loaded.located == ["line 1", "line 2"]


def test_bad_spec(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="format"):
        _batches(tiny_model_dir, DataSpec(format="sharegpt"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="data.format=chat needs data.path=FILE"):
        _batches(tiny_model_dir, DataSpec(format="chat"))  # the bundled demo set is alpaca
    with pytest.raises(ConfigError, match="no such file"):
        _batches(tiny_model_dir, DataSpec(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        _batches(tiny_model_dir, DataSpec(path=str(tmp_path / "data.csv")))
    with pytest.raises(ConfigError, match="micro_batch_size"):
        _batches(tiny_model_dir, micro_batch_size=0)


# A chat template of the usual shape; its markers are plain text, each turn ends with the tokenizer's EOS.
ROLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And the reverse of cat?"},
    {"role": "assistant", "content": "tac"},
]


def _chat_setup(model_dir: Path, tmp_path: Path, template: str | None,
                conversations: list[list[dict]]) -> tuple:
    """A copy of the tiny tokenizer with ``template`` as its chat template, and a chat JSONL file."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = template
    tok_dir = tmp_path / "tokenizer"
    tok.save_pretrained(tok_dir)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return AutoTokenizer.from_pretrained(tok_dir), tok_dir, path


def test_chat_loss_on_assistant_turns_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok, tok_dir, path = _chat_setup(tiny_model_dir, tmp_path, ROLE_TEMPLATE, [CHAT])
    sb = _batches(tok_dir, DataSpec(path=str(path), format="chat"), shuffle=False, micro_batch_size=1,
                  num_micro_batches=1)
    ids, labels = sb.encode(0)
    # Independently: encode the template's pieces one by one; loss on each reply and the EOS that ends it.
    want_ids, want_labels = [tok.bos_token_id], [IGNORE_INDEX]
    for m in CHAT:
        head = tok(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
        body = tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        want_ids += head + body
        reply = m["role"] == "assistant"
        want_labels += [IGNORE_INDEX] * len(head) + (body if reply else [IGNORE_INDEX] * len(body))
    assert (ids, labels) == (want_ids, want_labels)
    assert ids == tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "Four.</s>tac</s>"
    # Truncation to seq_len cuts both, as for the other formats.
    cut = len(ids) - 2  # inside the last reply
    short = _batches(tok_dir, DataSpec(path=str(path), format="chat"), seq_len=cut, micro_batch_size=1,
                     num_micro_batches=1).step(0)
    assert short.input_ids.flatten().tolist() == ids[:cut] and short.labels.flatten().tolist() == labels[:cut]
    every = _batches(tok_dir, DataSpec(path=str(path), format="chat", train_on_prompt=True)).encode(0)
    assert every == (ids, ids)


def test_chat_label_covers_a_token_straddling_the_reply_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The generation prompt ends in a space that the reply's first token (" is") absorbs: that token is
    # the reply's, so it carries a label though it starts inside the prompt.
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}"
                "Assistant: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}Assistant: {% endif %}")
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "is four"}]
    tok, tok_dir, path = _chat_setup(tiny_model_dir, tmp_path, template, [conversation])
    ids, labels = _batches(tok_dir, DataSpec(path=str(path), format="chat")).encode(0)
    first = labels.index(next(t for t in labels if t != IGNORE_INDEX))
    assert tok.convert_ids_to_tokens(ids[first]) == "Ġis"
    assert tok.decode(ids[:first]) == "User: Hi\nAssistant:" and tok.decode(ids[first:]) == " is four</s>"
    assert labels[first:] == ids[first:]


def test_chat_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = DataSpec(path=str(tmp_path / "chat.jsonl"), format="chat")
    _chat_setup(tiny_model_dir, tmp_path, None, [CHAT])
    with pytest.raises(ConfigError, match="has no chat template; use data.format=alpaca or text"):
        _batches(tmp_path / "tokenizer", spec)
    # A template that shortens earlier replies (as some drop a model's reasoning from past turns): record 1's
    # first reply reads differently once more turns follow. check() finds it before the run, though step 0
    # only holds record 0.
    shortens = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}(reply)\n"
                "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
    _chat_setup(tiny_model_dir, tmp_path, shortens, [CHAT[1:3], CHAT])
    sb = _batches(tmp_path / "tokenizer", spec, shuffle=False, micro_batch_size=1, num_micro_batches=1)
    assert sb.step(0).num_label_tokens > 0
    with pytest.raises(ConfigError, match=r"line 2: the chat template renders .* messages\[2\] differently"):
        sb.check(0, 1, None)
    loose = _batches(tmp_path / "tokenizer", DataSpec(path=spec.path, format="chat", train_on_prompt=True))
    loose.check(0, 1, None)  # no turns to locate: every token has a label
    _chat_setup(tiny_model_dir, tmp_path, "{{ raise_exception('roles must alternate') }}", [CHAT])
    refused = "line 1: the tokenizer's chat template refuses this conversation: roles must alternate"
    with pytest.raises(ConfigError, match=refused) as info:
        _batches(tmp_path / "tokenizer", spec).check(0, 1, None)
    assert "\n" not in str(info.value)
    _chat_setup(tiny_model_dir, tmp_path, ROLE_TEMPLATE, [CHAT[2:]])
    with pytest.raises(ConfigError, match=r"line 1: messages\[0\] is an assistant turn"):
        _batches(tmp_path / "tokenizer", spec).check(0, 1, None)


def test_sharegpt_conversations_read_as_chat(tiny_model_dir: Path, tmp_path: Path) -> None:
    """ShareGPT's {from, value} turns under data.format=chat encode exactly as the same turns as messages."""
    _, tok_dir, path = _chat_setup(tiny_model_dir, tmp_path, ROLE_TEMPLATE, [CHAT])
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                                       for m in CHAT]}]))
    want = _batches(tok_dir, DataSpec(path=str(path), format="chat")).encode(0)
    assert _batches(tok_dir, DataSpec(path=str(sharegpt), format="chat")).encode(0) == want


def test_tiny_chat_template_reads_like_alpaca(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The demo model's template renders a one-turn conversation as the alpaca prompt + response.
    plain = [r for r in DEMO if not r.get("input")]
    assert len(plain) >= 50
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["instruction"]},
                                                     {"role": "assistant", "content": r["output"]}]}) + "\n"
                            for r in plain))
    chat = _batches(tiny_model_dir, DataSpec(path=str(path), format="chat"), shuffle=False)
    alpaca = _batches(tiny_model_dir, shuffle=False)
    demo_index = [i for i, r in enumerate(DEMO) if not r.get("input")]
    assert [chat.encode(i) for i in range(len(plain))] == [alpaca.encode(i) for i in demo_index]


def test_held_out_data_is_read_in_the_training_format(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                       tmp_path: Path) -> None:
    tok, _, path = _chat_setup(tiny_model_dir, tmp_path, None, [CHAT, CHAT[1:3]])
    plan = SimpleNamespace(data=DataSpec(format="chat"), model=tiny_spec, train=TrainSpec(micro_batch_size=1))
    evaluation = EvalSpec(every=1, path=str(path), max_batches=8)
    batches = held_out_batches(plan, evaluation)  # type: ignore[arg-type]
    assert batches.data.format == "chat" and batches.num_micro_batches == 2  # fewer records than max_batches
    batch = batches.step(0)
    assert tok.decode(batch.labels[0, 0][batch.labels[0, 0] != IGNORE_INDEX]) == "Four.</s>tac</s>"
