"""A character-level tokenizer built offline (no hub), wrapped as a HF fast tokenizer.

Vocabulary (ids are stable, so saved models stay valid):

    0 <pad>   1 <bos>   2 <eos>   3 <unk>
    4..99     one token per character of BASE_CHARS: digits, ASCII letters,
              ASCII punctuation, " ", "\\n" (in that order; "0" is id 4)
    100..259  the remaining byte values (tab, control bytes, UTF-8 bytes)
    260..     one token per non-ASCII character of `extra_chars` (+ BPE intermediates)

Why byte-level: transformers 5 `AutoTokenizer` ignores `tokenizer_class` in a
directory whose config.json says model_type "qwen2" and rebuilds the tokenizer
as `Qwen2Tokenizer` (byte-level BPE + NFC + Qwen's pre-split regex) from the
saved vocab/merges. A plain char-level WordLevel tokenizer breaks under that
(spaces vanish); this byte-level BPE with no merges between characters gives
the same ids under both `PreTrainedTokenizerFast` and `Qwen2Tokenizer`. It is
also lossless: any text round-trips exactly (after NFC normalisation), ASCII at
one token per character, other characters at one token per UTF-8 byte unless
listed in `extra_chars`. <unk> is therefore never produced. Token *strings*
are byte-level symbols ("Ġ" is space, "Ċ" newline); use decode() for text.

Encoding adds no special tokens (no BOS/EOS): Qwen2-style models need no BOS,
and the rollout appends EOS where a target sequence needs one.

The chat template renders a conversation as the plain concatenation of
message contents, with no generation prompt, so a verl prompt
[{"role": "user", "content": "3+4="}] becomes "3+4=" and the model continues
straight after it.
"""
from __future__ import annotations

import os
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
BASE_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode-symbol map, the alphabet of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Character-level `PreTrainedTokenizerFast`: one token per character of BASE_CHARS.

    `extra_chars`: non-ASCII characters (e.g. "€é") that should be single tokens
    instead of one token per UTF-8 byte; ASCII characters in it are no-ops.
    """
    b2u = bytes_to_unicode()
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in BASE_CHARS:
        vocab.setdefault(b2u[ord(ch)], len(vocab))
    for b in range(256):
        vocab.setdefault(b2u[b], len(vocab))
    merges: list[tuple[str, str]] = []
    for ch in dict.fromkeys(extra_chars):  # dedupe, keep order
        symbols = [b2u[b] for b in ch.encode("utf-8")]
        cur = symbols[0]
        for sym in symbols[1:]:  # fold the char's bytes left to right; BPE needs each prefix in vocab
            if (cur, sym) not in merges:
                merges.append((cur, sym))
            cur += sym
            vocab.setdefault(cur, len(vocab))
    # unk_token=None mirrors Qwen2Tokenizer's BPE; with all 256 bytes in vocab nothing is unknown.
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()  # Qwen2Tokenizer applies NFC too
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | os.PathLike) -> Path:
    """Save to `directory`; reload with `transformers.AutoTokenizer.from_pretrained(directory)`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory
