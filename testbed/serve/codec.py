"""Text <-> token ids for the server: the checkpoint's tokenizer, or a documented fallback.

With a checkpoint that ships a tokenizer (`tokenizer.json`/`tokenizer_config.json`, loaded with
transformers' AutoTokenizer, offline), prompts are encoded and outputs decoded with it, chat
messages go through its chat template when it has one (else the fallback's lines below, encoded
by the tokenizer), and its EOS id ends a request (unless the client sets `ignore_eos`).

Random-weight checkpoints built on this machine (`model=tiny-llama` on CPU) ship their own
tokenizer.json (engine/torch_exec/weights/random_tokenizer.py): token t is the word `t`, so replies read
`"17 30512 8"` and an outside client given that file counts exactly the server's tokens; any
word that is not an id is id 0; there is no EOS.

Fallback (checkpoints without a tokenizer, random weights built on the GPUs, `executor=sim`):
- output token id `t` renders as the text `" t"` (a space, then the decimal id), so a reply is
  the readable list of ids the model sampled: `" 17 30512 8"`;
- a text prompt made only of whitespace-separated ASCII decimal integers is read back as those ids (so a reply
  can be fed back as a prompt; one of more than 19 digits is refused as outside the vocabulary, as a
  large id is); any other text is encoded as its UTF-8 bytes, one id per byte;
- chat messages are joined as `"<role>: <content>\n"` lines followed by `"assistant:"`;
- there is no EOS: a request ends at `max_tokens` or a stop string.
`executor=sim` samples nothing: its placeholder token k of a reply is id k (text `" 0 1 2 ..."`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

MAX_ID_DIGITS = 19  # a token id is an int64; Python refuses int() of more than 4,300 digits (HTTP 500: issue 38 item 8)


class Codec:
    """Encode prompts, decode replies, and know the EOS ids."""

    name = "fallback"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        parts = text.split()
        if parts and all(p.isascii() and p.isdigit() for p in parts):  # not "²" or "٣": text
            long = next((p for p in parts if len(p) > MAX_ID_DIGITS), None)
            if long is not None:
                raise ValueError(f"token id of {len(long)} digits ({long[:12]}...) is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            return [int(p) for p in parts]
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" {int(t)}" for t in ids)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return list(chat_text(messages).encode("utf-8"))


class HFCodec(Codec):
    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], name: str = "transformers") -> None:
        super().__init__(vocab_size)
        self.name = name
        self.tok = tokenizer
        self.eos_token_ids = frozenset(int(e) for e in eos_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding in newer transformers
                out = out["input_ids"]
            return [int(t) for t in out]
        return self.encode(chat_text(messages))  # no template: the fallback's lines, through the tokenizer


def chat_text(messages: list[dict]) -> str:
    """Chat messages without a template: `"<role>: <content>\n"` lines, then `"assistant:"`."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def load_codec(model_path: str | None, vocab_size: int) -> Codec:
    """The checkpoint's tokenizer when it has one, else the fallback (see the module docstring).
    A random-weight checkpoint's tokenizer (engine/torch_exec/weights/random_tokenizer.py) has no EOS."""
    if model_path and any(os.path.exists(os.path.join(model_path, f))
                          for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        random = os.path.exists(os.path.join(model_path, "testbed_model.json"))
        eos = [] if random else _eos_ids(model_path, tok)
        return HFCodec(tok, vocab_size, eos, name="random-tokenizer" if random else "transformers")
    return Codec(vocab_size)


def _eos_ids(model_path: str, tok) -> list[int]:
    import json

    ids = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    try:
        with open(os.path.join(model_path, "generation_config.json")) as f:
            e = json.load(f).get("eos_token_id")
        ids.update([e] if isinstance(e, int) else (e or []))
    except (OSError, ValueError):
        pass
    return sorted(ids)
