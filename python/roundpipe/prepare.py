"""Turns data as users have it into a token file for roundpipe-train and
roundpipe.train, tokenised by the model's own tokenizer (transformers'
AutoTokenizer) and read by ``datasets`` (JSONL, JSON, Parquet, CSV, or a
dataset name):

    python -m roundpipe.prepare --tokenizer Qwen/Qwen3-8B --data chats.jsonl \\
        --output chats.rpt

Formats (``--format auto`` picks by the columns):

- ``text``: a ``text`` column; every token is trained on; eos appended.
- ``prompt_completion``: ``prompt`` and ``completion`` strings; only the
  completion (and eos) is trained on.
- ``chat``: ``messages`` (``role``/``content``) or ShareGPT
  ``conversations`` (``from``/``value``), rendered with the tokenizer's chat
  template; only the assistant turns (their content and end-of-turn) are
  trained on.

``--train-on all`` trains on every token instead. The file records the
tokenizer's name and the fingerprints of its tokenizer.json and of the chat
template it applied: roundpipe-train refuses a model whose tokenizer differs.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from .token_file import Example, fnv1a64, write_token_file

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}


def detect_format(columns: Sequence[str]) -> str:
    if "messages" in columns or "conversations" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise ValueError(f"cannot tell the data's format from its columns {list(columns)}: it needs "
                     "'text', 'prompt' and 'completion', 'messages' or 'conversations' "
                     "(or pass --format and --text-field)")


def to_messages(row: dict) -> List[Dict[str, str]]:
    """The row's conversation as role/content messages (ShareGPT's
    from/value converted)."""
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
        for m in messages:
            if "role" not in m or "content" not in m:
                raise ValueError(f"a message needs 'role' and 'content', got keys {sorted(m)}")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    out = []
    for m in row["conversations"]:
        who = m.get("from")
        if who not in _SHAREGPT_ROLES:
            raise ValueError(f"ShareGPT turn from {who!r}: expected one of {sorted(_SHAREGPT_ROLES)}")
        out.append({"role": _SHAREGPT_ROLES[who], "content": m["value"]})
    return out


def _with_eos(tokenizer, ids: List[int]) -> List[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def tokenize_text(tokenizer, text: str, train_on: str = "all") -> Example:
    ids = _with_eos(tokenizer, tokenizer(text)["input_ids"])
    return Example(ids, [1] * len(ids))


def tokenize_prompt_completion(tokenizer, prompt: str, completion: str,
                               train_on: str = "completion") -> Example:
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = _with_eos(tokenizer, tokenizer(completion, add_special_tokens=False)["input_ids"])
    trained_prompt = 1 if train_on == "all" else 0
    return Example(prompt_ids + completion_ids,
                   [trained_prompt] * len(prompt_ids) + [1] * len(completion_ids))


def chat_template_text(tokenizer) -> Optional[str]:
    """The template apply_chat_template uses: the tokenizer's, or its
    "default" one where it has several (a dict)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return template


def assistant_spans(tokenizer, messages: List[dict], text: str) -> List[Tuple[int, int]]:
    """Character spans of ``text`` (the whole conversation rendered) that
    hold the assistant turns: each one's content and the end-of-turn marker
    the template puts after it (found by rendering the conversation up to
    that turn). The content is looked for after the conversation before the
    turn (rendered with the generation prompt, where that is how ``text``
    begins), never in an earlier message that happens to hold the same
    words. Works with templates that render earlier turns differently once
    later ones follow (Qwen3's). A turn without content (a tool call) spans
    what the template writes for it (its calls, its end of turn)."""
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"] or ""
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True,
                                               tokenize=False) if i > 0 else ""
        if before and text.startswith(before):
            cursor = max(cursor, len(before))
        if not content.strip():
            upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
            written = upto[len(before):].rstrip() if upto.startswith(before) else ""
            # (Rendered as the last turn it may carry more than it does
            # here, as a prefix: the longest ending that is here counts.)
            for k in range(len(written)):
                if text.startswith(written[k:], cursor):
                    spans.append((cursor, cursor + len(written) - k))
                    cursor += len(written) - k
                    break
            continue
        start = text.find(content, cursor)
        if start < 0 and content.strip():
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:
            raise ValueError(f"assistant turn {i}: its content does not appear in the rendered "
                             "conversation (the chat template rewrites it); use --train-on all")
        end = start + len(content)
        # The end of the turn: what the template writes after the content
        # when the conversation ends there (e.g. "<|im_end|>").
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        at = upto.rfind(content)
        marker = upto[at + len(content):].rstrip() if at >= 0 else ""
        if marker and text.startswith(marker, end):
            end += len(marker)
        spans.append((start, end))
        cursor = end
    return spans


def tokenize_chat(tokenizer, messages: List[dict], train_on: str = "assistant",
                  use_generation_markers: Optional[bool] = None) -> Example:
    """The conversation through the tokenizer's chat template, trained on
    the assistant turns only (``train_on="assistant"``) or on every token.
    A template with ``{% generation %}`` markers gives transformers' own
    assistant mask; else the assistant spans (:func:`assistant_spans`) are
    mapped to tokens through the fast tokenizer's offsets."""
    template = chat_template_text(tokenizer)
    if template is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path} has no chat template: chat data "
                         "needs one (pass the instruct model's tokenizer)")
    if use_generation_markers is None:
        use_generation_markers = "{% generation %}" in template or "{%- generation %}" in template
    if use_generation_markers:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        mask = list(out["assistant_masks"]) if train_on != "all" else [1] * len(ids)
        return Example(ids, [int(bool(m)) for m in mask])
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_on == "all":
        return Example(ids, [1] * len(ids))
    spans = assistant_spans(tokenizer, messages, text)
    trained = []
    for begin, end in enc["offset_mapping"]:
        trained.append(int(any(begin < e and end > b for b, e in spans)))
    return Example(ids, trained)


def tokenizer_metadata(tokenizer, chat_template_used: bool) -> dict:
    """What the token file records of the tokenizer: its name, vocabulary
    size, and fingerprints of its tokenizer.json and of the chat template
    applied (empty where there is none)."""
    fingerprint = ""
    try:
        from transformers.utils import cached_file
        path = cached_file(tokenizer.name_or_path, "tokenizer.json",
                           _raise_exceptions_for_missing_entries=False)
        if path is not None:
            with open(path, "rb") as f:
                fingerprint = fnv1a64(f.read())
    except (OSError, ValueError):
        fingerprint = ""
    # (Line ends as transformers reads the template: "\n"; the C++ check
    # reads the file the same way.)
    template = chat_template_text(tokenizer) if chat_template_used else None
    if template:
        template = template.replace("\r\n", "\n")
    return dict(tokenizer=tokenizer.name_or_path, vocab_size=len(tokenizer),
                tokenizer_fingerprint=fingerprint,
                chat_template_fingerprint=fnv1a64(template.encode()) if template else "",
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def load_rows(data: str, split: str = "train"):
    """Rows of a local file (JSONL/JSON, Parquet, CSV, by extension) or of
    a dataset name, through ``datasets``."""
    import datasets
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    ext = os.path.splitext(data)[1].lower()
    if os.path.exists(data):
        if ext not in builders:
            raise ValueError(f"{data}: cannot tell its type from the extension {ext!r}; use "
                             ".jsonl, .json, .parquet or .csv")
        return datasets.load_dataset(builders[ext], data_files=data, split=split)
    return datasets.load_dataset(data, split=split)


def prepare(tokenizer, rows, output: str, fmt: str = "auto", train_on: Optional[str] = None,
            max_length: Optional[int] = None, text_field: str = "text") -> dict:
    """Tokenises ``rows`` (a datasets.Dataset or a list of dicts) into the
    token file ``output``; returns its header."""
    columns = rows.column_names if hasattr(rows, "column_names") else (list(rows[0]) if rows else [])
    if fmt == "auto":
        fmt = "text" if text_field != "text" and text_field in columns else detect_format(columns)
    if fmt not in ("text", "prompt_completion", "chat"):
        raise ValueError(f"--format must be auto, text, prompt_completion or chat, got {fmt!r}")
    train_on = train_on or {"text": "all", "prompt_completion": "completion",
                            "chat": "assistant"}[fmt]

    def examples():
        for i, row in enumerate(rows):
            try:
                if fmt == "text":
                    ex = tokenize_text(tokenizer, row[text_field], train_on)
                elif fmt == "prompt_completion":
                    ex = tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"],
                                                    train_on)
                else:
                    ex = tokenize_chat(tokenizer, to_messages(row), train_on)
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"example {i}: {error}") from error
            if max_length is not None:
                ex = Example(ex.input_ids[:max_length], ex.trained[:max_length])
            yield ex

    metadata = tokenizer_metadata(tokenizer, chat_template_used=fmt == "chat")
    metadata.update(source_format=fmt, train_on=train_on, max_length=max_length)
    return write_token_file(output, examples(), metadata)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m roundpipe.prepare",
        description="Tokenise a dataset with the model's tokenizer into a token file for "
                    "roundpipe-train --data (and roundpipe.train).")
    parser.add_argument("--tokenizer", required=True,
                        help="the model's directory or hub name (AutoTokenizer.from_pretrained)")
    parser.add_argument("--data", required=True,
                        help="JSONL/JSON, Parquet or CSV file, or a dataset name (datasets)")
    parser.add_argument("--output", required=True, help="the token file to write")
    parser.add_argument("--format", default="auto",
                        choices=["auto", "text", "prompt_completion", "chat"])
    parser.add_argument("--train-on", choices=["all", "completion", "assistant"], default=None,
                        help="which tokens are labels (default: all for text, the completion, "
                             "the assistant turns)")
    parser.add_argument("--max-length", type=int, default=None, help="cut examples to N tokens")
    parser.add_argument("--text-field", default="text", help="the column of plain text")
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = load_rows(args.data, args.split)
    try:
        header = prepare(tokenizer, rows, args.output, args.format, args.train_on,
                         args.max_length, args.text_field)
    except ValueError as error:
        print(f"roundpipe.prepare: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {header['num_examples']} examples, {header['num_tokens']} tokens "
          f"({header['trained_tokens']} trained on), format {header['source_format']}, "
          f"tokenizer {header['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
