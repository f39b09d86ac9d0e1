"""How an alpaca record becomes prompt text: the templates the data pipeline, generate and the tiny model's tokenizer share."""

from __future__ import annotations

from typing import Any

# Alpaca-style prompt. Loss is on the response (and EOS) only unless data.train_on_prompt.
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def render_alpaca(record: dict[str, Any]) -> str:
    """The prompt text for an alpaca record (instruction, optional input), up to the response."""
    extra = record.get("input") or ""
    if extra:
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=extra)
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])
