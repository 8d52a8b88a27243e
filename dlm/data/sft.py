"""Chat / instruction JSONL -> ``(input_ids, labels)`` with the chat template and prompt masking.

Accepted record layouts (one JSON object per line):

- OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}``
- prompt/response: ``{"prompt": "...", "response": "..."}``; also ``instruction`` (+ optional ``input``) /
  ``output``, ``question`` / ``answer``, ``completion``, and an optional ``system``.

Only the assistant turns are trained: every other token gets label -100. Each turn is tokenized as its own
segment of the rendered chat template (prompt up to and including the generation prompt, then the assistant
content with its end-of-turn tokens), so the token boundary between prompt and answer is the one the model sees
at inference, where the prompt is tokenized with ``add_generation_prompt=True`` and the answer is generated.
Labels are aligned with ``input_ids`` (not shifted); the objectives do any shifting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.errors import DLMError

IGNORE_INDEX = -100

_ROLE = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
_PROMPT_KEYS = ("prompt", "instruction", "question", "query")
_RESPONSE_KEYS = ("response", "output", "completion", "answer", "chosen")

EXPECTED = (
    "'messages' (list of {role, content}), 'conversations' (list of {from, value}), or a prompt field "
    f"({'/'.join(_PROMPT_KEYS)}) with a response field ({'/'.join(_RESPONSE_KEYS)})"
)

# Used when a tokenizer has no chat template (base models): a plain, documented layout.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; DLMError naming file:line on bad JSON."""
    path = Path(path)
    if not path.is_file():
        raise DLMError(f"data file '{path}' does not exist; pass a chat/instruction JSONL with --data FILE.jsonl")
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DLMError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from e
            if not isinstance(rec, dict):
                raise DLMError(f"{path}:{lineno}: each line must be a JSON object with {EXPECTED}")
            records.append((lineno, rec))
    if not records:
        raise DLMError(f"data file '{path}' holds no records")
    return records


def record_to_messages(rec: dict, where: str = "record") -> list[dict[str, str]]:
    """Normalize one record of any accepted layout to OpenAI-style messages."""
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise DLMError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        out = [{"role": str(m["role"]), "content": _text(m["content"], where)} for m in msgs]
    elif "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not all(isinstance(m, dict) and "from" in m and "value" in m for m in conv):
            raise DLMError(f"{where}: 'conversations' must be a list of {{from, value}} objects (ShareGPT)")
        out = []
        for m in conv:
            role = _ROLE.get(str(m["from"]).lower())
            if role is None:
                raise DLMError(
                    f"{where}: unknown ShareGPT speaker '{m['from']}'; use one of {', '.join(sorted(_ROLE))}"
                )
            out.append({"role": role, "content": _text(m["value"], where)})
    else:
        pk = next((k for k in _PROMPT_KEYS if k in rec), None)
        rk = next((k for k in _RESPONSE_KEYS if k in rec), None)
        if pk is None or rk is None:
            raise DLMError(f"{where}: unknown record layout with fields {sorted(rec)}; expected {EXPECTED}")
        prompt = _text(rec[pk], where)
        if rec.get("input"):
            prompt = f"{prompt}\n\n{_text(rec['input'], where)}"
        out = []
        if rec.get("system"):
            out.append({"role": "system", "content": _text(rec["system"], where)})
        out += [{"role": "user", "content": prompt}, {"role": "assistant", "content": _text(rec[rk], where)}]
    if not any(m["role"] == "assistant" for m in out):
        raise DLMError(f"{where}: the conversation has no assistant turn, so nothing would be trained")
    return out


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and "text" in p for p in value):  # OpenAI content parts
        return "".join(str(p["text"]) for p in value)
    raise DLMError(f"{where}: message content must be a string, got {type(value).__name__}")


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
    )


def tokenize_messages(messages: list[dict], tokenizer, max_length: int | None = None) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` for one conversation; labels are -100 except on assistant turns.

    The rendered conversation is cut at turn boundaries: for assistant turn k the prompt segment ends at
    ``render(messages[:k], add_generation_prompt=True)`` and the trained segment runs to ``render(messages[:k+1])``.
    Truncation to ``max_length`` keeps the beginning.
    """
    ids: list[int] = []
    labels: list[int] = []
    done = ""  # text already tokenized
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt_text = _render(tokenizer, messages[:k], add_generation_prompt=True)
        full_text = _render(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if not prompt_text.startswith(done) or not full_text.startswith(prompt_text):
            raise DLMError(
                "the tokenizer's chat template does not render conversations as growing prefixes, so "
                "prompt masking cannot find the assistant turns; use a ChatML-style template"
            )
        seg_prompt = tokenizer(prompt_text[len(done) :], add_special_tokens=False)["input_ids"]
        seg_answer = tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
        ids += seg_prompt + seg_answer
        labels += [IGNORE_INDEX] * len(seg_prompt) + list(seg_answer)
        done = full_text
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def load_sft_examples(
    path: str | Path, tokenizer, max_length: int, records: Iterable[tuple[int, dict]] | None = None
) -> list[dict[str, Any]]:
    """Tokenized examples of a JSONL file; records whose answer is cut away entirely by ``max_length`` are
    dropped (they would train nothing). Each example keeps its line number as ``index``."""
    examples = []
    dropped = 0
    for lineno, rec in records if records is not None else read_jsonl(path):
        msgs = record_to_messages(rec, where=f"{path}:{lineno}")
        ex = tokenize_messages(msgs, tokenizer, max_length)
        if not any(x != IGNORE_INDEX for x in ex["labels"]):
            dropped += 1
            continue
        ex["index"] = lineno
        examples.append(ex)
    if not examples:
        raise DLMError(
            f"no record of '{path}' keeps an answer token within {max_length} tokens "
            f"({dropped} dropped); raise --seq-length / cutoff_len"
        )
    return examples


@dataclass
class SFTCollator:
    """Pads a list of examples to the longest (rounded up to ``pad_to_multiple_of``, capped at ``max_length``).

    Returns LongTensors ``input_ids``, ``labels`` (-100 on padding) and ``attention_mask`` (1 real, 0 pad), all
    ``[B, L]``, right-padded so that real tokens keep positions 0..n-1 under causal attention.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        length = max(len(e["input_ids"]) for e in examples)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            length = -(-length // m) * m
        if self.max_length is not None:
            length = min(length, self.max_length)
        b = len(examples)
        input_ids = torch.full((b, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((b, length), dtype=torch.long)
        for i, e in enumerate(examples):
            n = min(len(e["input_ids"]), length)
            input_ids[i, :n] = torch.tensor(e["input_ids"][:n])
            labels[i, :n] = torch.tensor(e["labels"][:n])
            attention_mask[i, :n] = 1
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
        if all("index" in e for e in examples):
            batch["index"] = torch.tensor([e["index"] for e in examples])
        return batch


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (padding is never trained: labels are -100 there)."""
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    raise DLMError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token before training")
