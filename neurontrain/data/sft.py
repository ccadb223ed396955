"""Supervised fine-tuning data as TRL defines it: which format a dataset is, which tokens its loss is on, and the
token ids with their loss mask (1: the token is trained on, its label kept; 0: label -100).

Formats (TRL's): `text` (a text field, every token trained on), `messages` (a conversation, a list of
{role, content}, rendered with the chat template), `prompt-completion` (strings, or conversations: the prompt's
messages and the completion's). The masks follow TRL's SFTTrainer: a completion starts where the tokenized prompt
and prompt + completion part (`common_prefix_length`); a string completion gets the EOS token appended; assistant
turns are the spans a template marks with `{% generation %}` (`return_assistant_tokens_mask`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neurontrain.errors import UsageError, first_line

FIELDS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion")}
DEFAULT_LOSS_ON = {"text": "all", "messages": "assistant", "prompt-completion": "completion"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARKERS = re.compile(r"<\|[A-Za-z0-9_]+\|>")

# ChatML with the assistant turns marked for the loss (`{% generation %}`), as TRL's *_training.jinja templates do
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILT_IN_TEMPLATES = {"chatml": CHATML}


@dataclass(frozen=True)
class SFTFormat:
    """A dataset's resolved format, loss and chat template (None: text needs none)."""

    format: str
    loss_on: str
    template: str | None

    @property
    def masked(self) -> bool:
        """Whether a loss mask is stored with the ids (every format but text: its documents are never split)."""
        return self.format != "text"


def detect_format(declared: str, columns: Iterable[str], text_field: str) -> str:
    """The data's format: the declared one, or (auto) the one whose fields the data has, where only one fits."""
    names = set(columns)
    if declared != "auto":
        wanted = FIELDS.get(declared, (text_field,))
        missing = [f for f in wanted if f not in names]
        if missing:
            raise UsageError(
                f"data.format {declared} needs the field(s) {', '.join(missing)}; the data has {sorted(names)}"
            )
        return declared
    fits = [fmt for fmt, fields in FIELDS.items() if all(f in names for f in fields)]
    fits += ["text"] if text_field in names else []
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise UsageError(
            f"data.text_field {text_field!r} is not a column of the data, nor are the fields of messages "
            f"('messages') or prompt-completion ('prompt', 'completion') data (columns: {sorted(names)})"
        )
    raise UsageError(f"the data fits several formats ({', '.join(fits)}): set data.format")


def resolve_loss_on(fmt: str, declared: str) -> str:
    if declared == "auto":
        return DEFAULT_LOSS_ON[fmt]
    if declared == "completion" and fmt != "prompt-completion":
        raise UsageError(f"data.loss_on: completion needs prompt-completion data (the data is {fmt})")
    if declared == "assistant" and fmt == "text":
        raise UsageError("data.loss_on: assistant needs conversations (the data is text)")
    return declared


def template_text(spec: str | None, tokenizer: Any) -> str | None:
    """The chat template: a built-in one by name, a Jinja file's text, or the tokenizer's own (None: it has none)."""
    if spec is None:
        return getattr(tokenizer, "chat_template", None)
    if spec in BUILT_IN_TEMPLATES:
        return BUILT_IN_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"data.chat_template: {spec!r} is neither a file nor one of {sorted(BUILT_IN_TEMPLATES)}")
    return path.read_text()


def template_markers(template: str | None) -> list[str]:
    """The `<|...|>` tokens a template writes (a tokenizer trained on the data keeps each one whole)."""
    return sorted(set(_MARKERS.findall(template or "")))


def resolve(declared: str, loss_on: str, template_spec: str | None, columns: Iterable[str], text_field: str,
            tokenizer: Any, tokenizer_name: str) -> SFTFormat:  # fmt: skip
    """The data's format and loss, checked against the tokenizer's template before anything is tokenized."""
    fmt = detect_format(declared, columns, text_field)
    loss = resolve_loss_on(fmt, loss_on)
    template = template_text(template_spec, tokenizer) if fmt != "text" else None
    if fmt == "messages" and not template:
        raise UsageError(
            f"messages data needs a chat template and tokenizer {tokenizer_name} has none "
            "(name one with data.chat_template: a Jinja file, or chatml)"
        )
    if loss == "assistant" and template and not _GENERATION.search(template):
        raise UsageError(
            f"data.loss_on: assistant: the chat template of {tokenizer_name} cannot mark assistant turns (it has no "
            "{% generation %} block); set data.loss_on: all, or name a template that marks them (data.chat_template)"
        )
    return SFTFormat(fmt, loss, template)


def _conversational(value: Any) -> bool:
    return isinstance(value, list)


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


Encoded = tuple[list[list[int]], list[list[int]] | None]


def encoder_for_format(tokenizer: Any, sft: SFTFormat, encode_texts: Callable[[list[str]], list[list[int]]],
                       text_field: str) -> Callable[[dict], Encoded]:  # fmt: skip
    """Columns of a chunk -> (ids of each record, its loss mask; None for text, every token trained on)."""
    if sft.format == "text":
        return lambda columns: (encode_texts([str(t) for t in columns[text_field]]), None)
    if sft.format == "messages":
        return lambda columns: _messages(tokenizer, sft, columns["messages"])
    return lambda columns: _prompt_completion(tokenizer, sft, columns["prompt"], columns["completion"])


def _chat(tokenizer: Any, sft: SFTFormat, conversations: list, **kwargs: Any) -> dict:
    if not conversations:
        return {"input_ids": [], "assistant_masks": []}
    try:
        return tokenizer.apply_chat_template(
            conversations, chat_template=sft.template, tokenize=True, return_dict=True, **kwargs
        )
    except Exception as exc:  # jinja and transformers raise many types; the user needs one line
        raise UsageError(f"cannot render the conversations with the chat template: {first_line(exc)}") from None


def _check_messages(records: list, what: str) -> None:
    for i, messages in enumerate(records):
        ok = isinstance(messages, list) and messages
        if not ok or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise UsageError(f"{what} of record {i} of a chunk is not a non-empty list of {{role, content}} messages")


def _messages(tokenizer: Any, sft: SFTFormat, records: list) -> Encoded:
    _check_messages(records, "messages")
    assistant = sft.loss_on == "assistant"
    out = _chat(tokenizer, sft, records, return_assistant_tokens_mask=assistant)
    ids = [list(x) for x in out["input_ids"]]
    return ids, [list(m) for m in out["assistant_masks"]] if assistant else [[1] * len(x) for x in ids]


def _prompt_completion(tokenizer: Any, sft: SFTFormat, prompts: list, completions: list) -> Encoded:
    if all(_conversational(p) for p in prompts) and all(_conversational(c) for c in completions):
        _check_messages(prompts, "prompt")
        _check_messages(completions, "completion")
        prompt_ids = _chat(tokenizer, sft, prompts, add_generation_prompt=True)["input_ids"]
        assistant = sft.loss_on == "assistant"
        full = _chat(tokenizer, sft, [p + c for p, c in zip(prompts, completions)],
                     return_assistant_tokens_mask=assistant)  # fmt: skip
        ids = [list(x) for x in full["input_ids"]]
        extra = [list(m) for m in full["assistant_masks"]] if assistant else None
    elif all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions):
        if sft.loss_on == "assistant":
            raise UsageError("data.loss_on: assistant needs conversations; the prompts and completions are strings")
        eos = tokenizer.eos_token or ""
        texts = [c if c.endswith(eos) else c + eos for c in completions]
        prompt_ids = tokenizer(list(prompts))["input_ids"] if prompts else []
        ids = [list(x) for x in tokenizer([p + c for p, c in zip(prompts, texts)])["input_ids"]] if prompts else []
        extra = None
    else:
        raise UsageError("prompt and completion must both be strings or both be lists of messages in every record")
    if sft.loss_on == "all":
        return ids, [[1] * len(x) for x in ids]
    masks = []
    for i, (prompt, whole) in enumerate(zip(prompt_ids, ids)):
        start = common_prefix_length(prompt, whole)
        mask = [0] * start + [1] * (len(whole) - start)
        masks.append(mask if extra is None else [a & b for a, b in zip(mask, extra[i])])
    return ids, masks
