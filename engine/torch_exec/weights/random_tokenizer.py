"""The tokenizer shipped with every random-weight checkpoint (`tokenizer.json`, built with the
`tokenizers` library, no download), so that an outside benchmark client (aiperf, guidellm)
pointed at the checkpoint folder counts exactly the tokens the server counts.

Token id `t` is the word `t` (its decimal numeral): a reply decodes to the readable list of ids
the model sampled, `"17 30512 8"`, and encoding that text gives back exactly those ids, so a
client that re-tokenizes the reply counts exactly the server's completion tokens. Prompts are
split on whitespace; a word that is a numeral below the vocabulary size is that id, any other
word is id 0 (the unknown token). Random weights make no use of the text, so nothing is lost;
what matters is that server and client agree on every count.

Why not a byte-level BPE: with a vocabulary of 32,000 and 256 byte tokens, the random model's
sampled ids would decode to byte-pair strings that re-encode to other ids (merges across token
boundaries, lone bytes >= 0x80 that decode to U+FFFD), so the counts would differ. There is no
EOS: a random model's request ends at `max_tokens` or a stop string (testbed/serve/codec.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json")


def write_random_tokenizer(folder: str | os.PathLike, vocab_size: int, max_len: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into `folder` (each whole or not at all)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "testbed_random": True}
    for name, text in (("tokenizer.json", tok.to_str()), ("tokenizer_config.json", json.dumps(config, indent=1))):
        part = folder / f".{name}.part"
        part.write_text(text)
        os.replace(part, folder / name)


def has_tokenizer(folder: str | os.PathLike) -> bool:
    return all((Path(folder) / name).is_file() for name in FILES)
