"""Reading a stated answer letter and a verbalised confidence out of free model text (the
elicitation baseline): numbers, percentages, spelled-out numbers and qualitative levels."""

from __future__ import annotations

import re

from calm_lightning.metrics.semantic import UNIT_WORDS

_UNITS = {word: value for value, word in enumerate(UNIT_WORDS)}
_TENS = {
    w: 10 * (i + 2)
    for i, w in enumerate(
        ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
    )
}
# Qualitative answers, most specific first (documented in docs/posthoc.md).
_LEVELS = (
    ("very high", 0.95),
    ("very low", 0.05),
    ("certain", 0.95),
    ("high", 0.8),
    ("medium", 0.5),
    ("moderate", 0.5),
    ("low", 0.2),
)


def _number_words(text: str) -> float | None:
    """The first spelled-out number (0..100) in `text`, e.g. "ninety-five" -> 95."""
    words = re.findall(r"[a-z]+", text.lower())
    for i, word in enumerate(words):
        if word not in _UNITS and word not in _TENS and word != "hundred":
            continue
        value, j = 0, i
        if words[j] == "one" and j + 1 < len(words) and words[j + 1] == "hundred":
            return 100.0
        if words[j] == "hundred":
            return 100.0
        if words[j] in _TENS:
            value = _TENS[words[j]]
            if j + 1 < len(words) and words[j + 1] in _UNITS and 0 < _UNITS[words[j + 1]] < 10:
                value += _UNITS[words[j + 1]]
        else:
            value = _UNITS[words[j]]
        return float(value)
    return None


def parse_confidence(text: str) -> float | None:
    """A verbalised confidence in [0, 1] from model output, or None if there is none.

    Reads the text after the last "confidence" when present. Accepted: "80%", "80 percent",
    "0.8", "80" (numbers above 1 are percentages), spelled-out numbers ("eighty percent"),
    and the levels very high / certain / high / medium / moderate / low / very low.
    """
    lowered = text.lower()
    at = lowered.rfind("confidence")
    segment = lowered[at + len("confidence") :] if at >= 0 else lowered
    percent = re.search(r"(\d+(?:\.\d+)?)\s*(?:%|percent)", segment)
    if percent:
        value = float(percent.group(1)) / 100
        return value if 0.0 <= value <= 1.0 else None
    number = re.search(r"(?<![\w.])(\d+(?:\.\d+)?|\.\d+)", segment)
    if number:
        value = float(number.group(1))
        value = value / 100 if value > 1 else value
        return value if 0.0 <= value <= 1.0 else None
    spelled = _number_words(segment)
    if spelled is not None:
        return spelled / 100 if spelled > 1 or "percent" in segment else spelled
    for level, value in _LEVELS:
        if re.search(rf"\b{level}\b", segment):
            return value
    return None


def parse_answer_letter(text: str, letters: str) -> int | None:
    """The option index a model names: "Answer: B", a line starting "B." / "(B)", or a lone
    option letter; None if there is none."""
    allowed = "".join(letters)
    patterns = (
        rf"answer\s*(?:is|:)?\s*\(?([{allowed}])\b",
        rf"(?m)^\s*\(?([{allowed}])[\).:]",
        rf"\b([{allowed}])\b",
    )
    for pattern in patterns:
        match = re.search(pattern, text, flags=re.IGNORECASE if pattern.startswith("answer") else 0)
        if match:
            return letters.index(match.group(1).upper())
    return None
