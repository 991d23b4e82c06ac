"""The byte-level tokenizer the embedded thinker speaks.

Text is UTF-8 encoded and every byte ``b`` becomes id ``b + BYTE_OFFSET``; ids below the offset
are specials (``PAD_ID``, ``BOS_ID``, ``EOS_ID``, matching the thinker's ``config.json``) and ids
at or above ``BYTE_OFFSET + 256`` are unused vocabulary slots of the 512-entry thinker vocab.
Decoding skips every id that is not a byte, and undecodable byte sequences become U+FFFD, so any
id sequence the model samples decodes to a string.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
NUM_BYTES = 256
VOCAB_SIZE = BYTE_OFFSET + NUM_BYTES  # ids this tokenizer can produce; the model has 512


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
    return [BOS_ID, *ids] if add_bos else ids


def is_byte_id(token_id: int) -> bool:
    return BYTE_OFFSET <= token_id < BYTE_OFFSET + NUM_BYTES


def decode_bytes(ids: Iterable[int]) -> bytes:
    return bytes(t - BYTE_OFFSET for t in ids if is_byte_id(t))


def decode(ids: Iterable[int]) -> str:
    return decode_bytes(ids).decode("utf-8", errors="replace")


class ByteTokenizer:
    """Object form of this module's functions, for code that expects a tokenizer instance."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return encode(text, add_bos=add_bos)

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)
