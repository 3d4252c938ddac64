"""How rendered text becomes token ids, one way for every place that feeds a model (training,
letter and cloze scoring, sampling):

* a prompt is encoded without the tokenizer's special tokens (a chat template writes its own
  markers), then gets the BOS id in front when the tokenizer puts one there by default and the
  rendered text does not already start with it (Zephyr's template writes no `<s>`, while its
  tokenizer adds one: the model was trained with it);
* what follows a prompt (a response, an option letter) is read off the joint encoding of
  prompt + text, never encoded alone: a SentencePiece tokenizer spells "A" alone as `▁A` but
  after the prompt's final newline as `A`, another vocabulary row.
"""

from __future__ import annotations

# Any plain text will do: the probe only asks what the tokenizer puts in front of it.
_PROBE = "probe"


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts an encoding with its BOS id by default. Probed by encoding
    a text, since `add_bos_token` is not an attribute every tokenizer class keeps in sync with
    what its post-processor does."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer(_PROBE)["input_ids"]
    return bool(ids) and ids[0] == bos


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The ids a model reads for rendered `text`: its encoding without special tokens, with the
    BOS id in front when the tokenizer adds one by default and the text lacks it."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if adds_bos(tokenizer) and ids[:1] != [tokenizer.bos_token_id]:
        ids.insert(0, tokenizer.bos_token_id)
    return ids


def split_joint(tokenizer, prompt: str, text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, text ids) of `encode_prompt(prompt + text)`, split after the longest start
    it shares with `encode_prompt(prompt)`: the text's ids as they follow the prompt. Where a
    token spans the boundary it goes with the text, so the two parts always rejoin into the
    joint encoding."""
    head = encode_prompt(tokenizer, prompt)
    whole = encode_prompt(tokenizer, prompt + text)
    shared = 0
    for a, b in zip(head, whole, strict=False):
        if a != b:
            break
        shared += 1
    return whole[:shared], whole[shared:]


def text_ids_after(tokenizer, prompt: str, text: str) -> list[int] | None:
    """The ids `text` adds after the whole of `prompt` in their joint encoding; None when a
    token spans the boundary (the prompt's own ids are not a prefix of the joint ones)."""
    head, tail = split_joint(tokenizer, prompt, text)
    return tail if len(head) == len(encode_prompt(tokenizer, prompt)) else None


def cut_left(tokenizer, ids: list[int], limit: int) -> list[int]:
    """At most `limit` ids, losing them from the left; the BOS id `encode_prompt` put (or found)
    first stays first when the tokenizer adds one by default: the model always had it there."""
    if len(ids) <= limit:
        return ids
    if limit > 1 and ids[:1] == [tokenizer.bos_token_id] and adds_bos(tokenizer):
        return ids[:1] + ids[len(ids) - (limit - 1) :]
    return ids[len(ids) - limit :]
