"""Generate the project's offline demo data from the fact tables in `facts.py`.

A development tool, not runtime code: the package ships only the generated files. Everything is
templated or computed here, seeded, so the same seed always gives the same bytes:
`python -m tools.demo_data.build` (from the repository root) rewrites
`calm_lightning/data/demo/*.jsonl`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

from tools.demo_data import facts

DEMO_DIR = Path(__file__).resolve().parents[2] / "calm_lightning" / "data" / "demo"
SUBJECTS = ("geography", "chemistry", "biology", "arithmetic", "units")
DIFFICULTIES = ("easy", "medium", "hard")
PER_CELL = 48  # MCQA items per (subject, difficulty): 5 x 3 x 48 = 720
N_INSTRUCTIONS = 680
# 240 / 160 / 320 of 720; every subject has 144 items, which these fractions divide exactly.
MCQA_SPLITS = {"train": Fraction(1, 3), "heldout": Fraction(2, 9), "test": Fraction(4, 9)}
INSTRUCTION_SPLITS = {
    "train": Fraction(480, 680),
    "heldout": Fraction(100, 680),
    "test": Fraction(100, 680),
}

Draft = tuple[str, str, list[str]]  # question, correct answer, three wrong answers
Row = tuple[str, str, str]  # instruction, input, output

COUNTRIES = [
    {"name": n, "capital": c, "continent": k, "famous": f} for n, c, k, f in facts.COUNTRIES
]
ELEMENTS = [{"z": z, "symbol": s, "name": n, "origin": o} for z, s, n, o in facts.ELEMENTS]
ANIMALS = [{"name": n, "group": g, "tricky": t} for n, g, t in facts.ANIMALS]
UNITS = {s: {"plural": p, "dim": d, "size": v} for s, p, d, v in facts.UNITS}
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Wrong groups that people actually pick for the counter-intuitive animals.
MISCONCEPTIONS = {
    "whale": "fish",
    "dolphin": "fish",
    "seal": "fish",
    "bat": "bird",
    "platypus": "bird",
    "penguin": "mammal",
    "turtle": "amphibian",
    "tortoise": "amphibian",
    "salamander": "reptile",
    "axolotl": "fish",
    "shark": "mammal",
    "catfish": "mammal",
}


# --------------------------------------------------------------------------- text helpers


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _an(word: str) -> str:
    """`word` with its indefinite article (the vowel rule holds for every word used here)."""
    return f"{'an' if word[0].lower() in 'aeiou' else 'a'} {word}"


def _the(country: str) -> str:
    return f"the {country}" if country in facts.COUNTRIES_WITH_THE else country


def _join(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def _fmt(x: Fraction | int) -> str:
    """A number as plain decimal text (no separators); only finite decimals are allowed."""
    x = Fraction(x)
    for places in range(10):
        scaled = x * 10**places
        if scaled.denominator == 1:
            digits = str(abs(scaled.numerator)).rjust(places + 1, "0")
            text = digits if places == 0 else f"{digits[:-places]}.{digits[-places:]}"
            return f"-{text}" if x < 0 else text
    raise ValueError(f"{x} is not a short finite decimal")


def _is_short_decimal(x: Fraction, places: int = 6) -> bool:
    return (x * 10**places).denominator == 1


def _unit_name(unit: str, value: Fraction) -> str:
    return unit if value == 1 else UNITS[unit]["plural"]


def _plural(word: str) -> tuple[str, str]:
    """The regular plural of `word` and the rule that made it."""
    if word.endswith(("s", "x", "ch", "sh")):
        return word + "es", "Nouns ending in -s, -x, -ch or -sh add -es."
    if word.endswith("y") and word[-2] not in "aeiou":
        rule = "Nouns ending in a consonant followed by -y change the -y to -ies."
        return word[:-1] + "ies", rule
    if word.endswith("y"):
        return word + "s", "Nouns ending in a vowel followed by -y simply add -s."
    return word + "s", "Most nouns simply add -s."


# --------------------------------------------------------------------------- MCQA drafts


def _pick_distinct(
    rng: random.Random, candidates: Sequence[str], answer: str, k: int = 3
) -> list[str]:
    """`k` distinct wrong answers drawn at random from `candidates` (never the answer)."""
    unique = [c for c in dict.fromkeys(candidates) if c != answer]
    if len(unique) < k:
        raise ValueError(f"not enough distractors for {answer!r}: {unique}")
    return rng.sample(unique, k)


def _numeric_distractors(rng: random.Random, answer: int, near: Sequence[int]) -> list[str]:
    """Three plausible near-miss numbers (never negative, never the answer)."""
    pool = [n for n in dict.fromkeys(near) if n >= 0 and n != answer]
    # Small answers may not have enough listed near-misses; nearby numbers fill the gap.
    step = 1
    while len(pool) < 3:
        for n in (answer + step, answer - step):
            if n >= 0 and n != answer and n not in pool:
                pool.append(n)
        step += 1
    return [str(n) for n in rng.sample(pool, 3)]


def _geography(rng: random.Random) -> dict[str, list[Draft]]:
    by_continent: dict[str, list[dict]] = {}
    for c in COUNTRIES:
        by_continent.setdefault(c["continent"], []).append(c)
    # Oceania is a region, not a continent in every convention, so continent questions skip it.
    main_continents = [k for k in facts.CONTINENTS if k != "Oceania"]

    def capital_of(c: dict) -> Draft:
        neighbours = [o["capital"] for o in by_continent[c["continent"]] if o is not c]
        # A big non-capital city of the same country is the classic wrong answer.
        cities = facts.NON_CAPITAL_CITIES.get(c["name"], [])
        wrong = rng.sample(cities, 1) if cities else []
        wrong += _pick_distinct(rng, neighbours, c["capital"], 3 - len(wrong))
        return f"What is the capital of {_the(c['name'])}?", c["capital"], wrong

    def country_of(c: dict) -> Draft:
        neighbours = [o["name"] for o in by_continent[c["continent"]] if o is not c]
        wrong = _pick_distinct(rng, neighbours, c["name"])
        return f"{c['capital']} is the capital of which country?", c["name"], wrong

    def continent_of(c: dict) -> Draft:
        wrong = _pick_distinct(rng, main_continents, c["continent"])
        return f"On which continent is {_the(c['name'])}?", c["continent"], wrong

    famous = [c for c in COUNTRIES if c["famous"]]
    other = [c for c in COUNTRIES if not c["famous"]]
    on_continent = [c for c in COUNTRIES if c["continent"] != "Oceania"]
    return {
        "easy": [capital_of(c) for c in rng.sample(famous, 28)]
        + [continent_of(c) for c in rng.sample([c for c in famous if c in on_continent], 20)],
        "medium": [capital_of(c) for c in rng.sample(other, 28)]
        + [country_of(c) for c in rng.sample(famous, 20)],
        "hard": [country_of(c) for c in rng.sample(other, 28)]
        + [continent_of(c) for c in rng.sample([c for c in other if c in on_continent], 20)],
    }


def _chemistry(rng: random.Random) -> dict[str, list[Draft]]:
    def symbol_of(e: dict) -> Draft:
        name = e["name"]
        # Symbols a guess from the English name would give, then real symbols with that initial.
        guesses = [name[:2].title(), name[0].upper() + name[2], name[0].upper()]
        same_initial = [o["symbol"] for o in ELEMENTS if o["symbol"][0] == name[0].upper()]
        others = [o["symbol"] for o in ELEMENTS]
        candidates = list(dict.fromkeys(guesses + same_initial))
        if len([c for c in candidates if c != e["symbol"]]) < 3:
            candidates += rng.sample(others, 6)
        return (
            f"What is the chemical symbol for {name}?",
            e["symbol"],
            _pick_distinct(rng, candidates, e["symbol"]),
        )

    def name_of(e: dict) -> Draft:
        sym = e["symbol"]
        similar = [
            o["name"]
            for o in ELEMENTS
            if o["name"][0] == sym[0].lower() or o["symbol"][0] == sym[0]
        ]
        if len([n for n in similar if n != e["name"]]) < 3:
            similar += rng.sample([o["name"] for o in ELEMENTS], 6)
        return (
            f"Which element has the chemical symbol {sym}?",
            e["name"],
            _pick_distinct(rng, similar, e["name"]),
        )

    def number_of(e: dict) -> Draft:
        z = e["z"]
        near = [n for n in (z - 2, z - 1, z + 1, z + 2, z + 10, z - 10) if n >= 1]
        wrong = _numeric_distractors(rng, z, near)
        return f"What is the atomic number of {e['name']}?", str(z), wrong

    def element_with(e: dict) -> Draft:
        nearest = sorted((o for o in ELEMENTS if o is not e), key=lambda o: abs(o["z"] - e["z"]))
        wrong = rng.sample([o["name"] for o in nearest[:5]], 3)
        return f"Which element has atomic number {e['z']}?", e["name"], wrong

    latin = [e for e in ELEMENTS if e["origin"]]
    light = [e for e in ELEMENTS if e["z"] <= 20 and not e["origin"]]
    rest = [e for e in ELEMENTS if e["z"] > 20 and not e["origin"]]
    first10 = [e for e in ELEMENTS if e["z"] <= 10]
    next10 = [e for e in ELEMENTS if 10 < e["z"] <= 20]
    heavy = [e for e in ELEMENTS if e["z"] > 20]
    return {
        "easy": [symbol_of(e) for e in rng.sample(light, 16)]
        + [name_of(e) for e in rng.sample(light, 16)]
        + [number_of(e) for e in rng.sample(first10, 8)]
        + [element_with(e) for e in rng.sample(first10, 8)],
        "medium": [symbol_of(e) for e in rng.sample(rest, 16)]
        + [name_of(e) for e in rng.sample(rest, 16)]
        + [number_of(e) for e in rng.sample(next10, 8)]
        + [element_with(e) for e in rng.sample(next10, 8)],
        "hard": [symbol_of(e) for e in rng.sample(latin, 10)]
        + [name_of(e) for e in rng.sample(latin, 10)]
        + [number_of(e) for e in rng.sample(heavy, 14)]
        + [element_with(e) for e in rng.sample(heavy, 14)],
    }


def _biology(rng: random.Random) -> dict[str, list[Draft]]:
    groups = facts.ANIMAL_GROUPS
    plural = facts.GROUP_PLURALS
    by_group: dict[str, list[dict]] = {g: [a for a in ANIMALS if a["group"] == g] for g in groups}

    def group_of(a: dict) -> Draft:
        others = [g for g in groups if g != a["group"]]
        wrong = [MISCONCEPTIONS[a["name"]]] if a["name"] in MISCONCEPTIONS else []
        wrong += _pick_distinct(
            rng, [g for g in others if g not in wrong], a["group"], 3 - len(wrong)
        )
        question = f"To which group of animals does the {a['name']} belong?"
        return question, plural[a["group"]], [plural[g] for g in wrong]

    def same_group(a: dict) -> Draft:
        answer = rng.choice([o for o in by_group[a["group"]] if o is not a])["name"]
        other_groups = rng.sample([g for g in groups if g != a["group"]], 3)
        wrong = [rng.choice(by_group[g])["name"] for g in other_groups]
        question = f"Which of these animals belongs to the same group as the {a['name']}?"
        return question, answer, wrong

    def pair(a: dict, b: dict) -> Draft:
        first, second = sorted((a["name"], b["name"]))
        wrong = _pick_distinct(rng, [g for g in groups if g != a["group"]], a["group"])
        question = f"Which group of animals do both the {first} and the {second} belong to?"
        return question, plural[a["group"]], [plural[g] for g in wrong]

    def pairs(tricky: bool, k: int) -> list[Draft]:
        chosen: dict[tuple[str, str], Draft] = {}
        while len(chosen) < k:
            a = rng.choice([x for x in ANIMALS if x["tricky"] == tricky])
            b = rng.choice([x for x in by_group[a["group"]] if x is not a])
            key = tuple(sorted((a["name"], b["name"])))
            if key not in chosen:
                chosen[key] = pair(a, b)
        return list(chosen.values())

    def fact_drafts(level: str) -> list[Draft]:
        return [(q, a, list(w)) for q, a, w, d, _ in facts.BIOLOGY_FACTS if d == level]

    plain = [a for a in ANIMALS if not a["tricky"]]
    tricky = [a for a in ANIMALS if a["tricky"]]
    easy_facts, medium_facts, hard_facts = (fact_drafts(d) for d in DIFFICULTIES)
    return {
        "easy": easy_facts + [group_of(a) for a in rng.sample(plain, PER_CELL - len(easy_facts))],
        "medium": medium_facts
        + [same_group(a) for a in rng.sample(plain, 25)]
        + pairs(False, PER_CELL - len(medium_facts) - 25),
        "hard": hard_facts
        + [group_of(a) for a in tricky]
        + [same_group(a) for a in rng.sample(tricky, 12)]
        + pairs(True, PER_CELL - len(hard_facts) - len(tricky) - 12),
    }


def _arithmetic_draft(rng: random.Random, level: str) -> Draft:
    r = rng.randint
    kinds = {"easy": ["+", "-"], "medium": ["+", "-", "x", "*"], "hard": ["x", "/", "(", "m"]}
    kind = rng.choice(kinds[level])
    if level == "easy" and kind == "+":
        a, b = r(1, 9), r(1, 9)
        ans, expr, near = a + b, f"{a} + {b}", [a + b - 1, a + b + 1, a + b + 2, a + b - 2]
    elif level == "easy":
        a, b = r(10, 18), r(1, 9)
        ans, expr, near = a - b, f"{a} - {b}", [a - b - 1, a - b + 1, a + b, a - b + 10]
    elif kind == "+":
        a, b = r(15, 89), r(15, 89)
        ans, expr, near = a + b, f"{a} + {b}", [a + b - 10, a + b + 10, a + b - 1, a + b + 1]
    elif kind == "-":
        a, b = r(100, 999), r(11, 99)
        ans, expr, near = a - b, f"{a} - {b}", [a - b + 10, a - b - 10, a - b + 1, a + b]
    elif kind == "x":  # 2-digit x 1-digit (medium) or 3-digit x 2-digit (hard)
        a, b = (r(12, 99), r(3, 9)) if level == "medium" else (r(101, 999), r(11, 99))
        ans, expr = a * b, f"{a} × {b}"
        near = [a * (b - 1), a * (b + 1), ans + 10, ans - 10, ans + 100, ans - 100]
    elif kind == "*":  # 2-digit x 2-digit
        a, b = r(11, 49), r(11, 29)
        ans, expr = a * b, f"{a} × {b}"
        near = [a * (b - 1), a * (b + 1), ans + 10, ans - 10, (a + 1) * b]
    elif kind == "/":
        b, q = r(3, 25), r(12, 99)
        ans, expr = q, f"{b * q} ÷ {b}"
        near = [q - 1, q + 1, q + 10, q - 10, q * 10]
    elif kind == "(":
        a, b, c = r(2, 30), r(2, 30), r(3, 12)
        ans, expr = (a + b) * c, f"({a} + {b}) × {c}"
        # a + b × c is the classic slip of ignoring the brackets.
        near = [a + b * c, ans + c, ans - c, ans + 10]
    else:  # "m": multi-step without brackets, so precedence matters
        a, b = r(11, 40), r(3, 12)
        c = r(10, min(99, a * b - 1))  # keeps the result positive
        ans, expr = a * b - c, f"{a} × {b} - {c}"
        near = [a * b + c, ans + a, ans - a, ans + 10, ans - 10]  # a * b + c: a sign slip
    return f"What is {expr}?", str(ans), _numeric_distractors(rng, ans, near)


# (from, to) unit pairs per difficulty; easy ones go to a smaller unit with one whole factor,
# medium ones need a decimal, hard ones chain two steps or use an imperial definition.
UNIT_PAIRS = {
    "easy": [
        ("kilometre", "metre"),
        ("metre", "centimetre"),
        ("centimetre", "millimetre"),
        ("kilogram", "gram"),
        ("gram", "milligram"),
        ("tonne", "kilogram"),
        ("litre", "millilitre"),
        ("hour", "minute"),
        ("minute", "second"),
        ("day", "hour"),
        ("week", "day"),
    ],
    "medium": [
        ("metre", "kilometre"),
        ("centimetre", "metre"),
        ("millimetre", "centimetre"),
        ("gram", "kilogram"),
        ("millilitre", "litre"),
        ("minute", "hour"),
        ("second", "minute"),
        ("kilometre", "metre"),
        ("kilogram", "gram"),
        ("litre", "millilitre"),
        ("hour", "minute"),
        ("metre", "millimetre"),
    ],
    "hard": [
        ("kilometre", "centimetre"),
        ("hour", "second"),
        ("day", "minute"),
        ("week", "hour"),
        ("tonne", "gram"),
        ("kilogram", "milligram"),
        ("inch", "centimetre"),
        ("foot", "inch"),
        ("foot", "centimetre"),
        ("litre", "cubic centimetre"),
        ("millimetre", "metre"),
        ("second", "hour"),
        ("minute", "day"),
        ("millilitre", "cubic centimetre"),
    ],
}


def _conversion(rng: random.Random, level: str) -> tuple[str, str, Fraction, Fraction]:
    """A random (from unit, to unit, value, result) with short decimal numbers."""
    while True:
        src, dst = rng.choice(UNIT_PAIRS[level])
        ratio = UNITS[src]["size"] / UNITS[dst]["size"]
        if ratio >= 1:  # to a smaller unit: pick the value
            if level == "medium":
                value = Fraction(rng.randint(3, 99), rng.choice([2, 4, 10]))
            else:
                value = Fraction(rng.randint(2, 15 if level == "easy" else 12))
            result = value * ratio
        else:  # to a bigger unit: pick a tidy result, then the value that gives it
            result = Fraction(rng.randint(1, 40), rng.choice([2, 4, 10, 20]))
            value = result / ratio
        short = value.denominator == 1 or _is_short_decimal(value, 2)
        if short and _is_short_decimal(result, 4) and value <= 10**6:
            return src, dst, value, result


def _units_draft(rng: random.Random, level: str) -> Draft:
    src, dst, value, result = _conversion(rng, level)
    ratio = UNITS[src]["size"] / UNITS[dst]["size"]
    # Wrong answers: a slipped decimal point, or the factor applied the wrong way round.
    near = [result * 10, result / 10, result * 100, result / 100, value / ratio]
    if UNITS[src]["dim"] == "time":
        near += [result * Fraction(10, 6), result * Fraction(6, 10)]  # 100 taken for 60
    wrong = [_fmt(n) for n in near if n > 0 and _is_short_decimal(n) and n != result]
    if rng.random() < 0.5:
        question = f"How many {UNITS[dst]['plural']} are in {_fmt(value)} {_unit_name(src, value)}?"
    else:
        question = f"What is {_fmt(value)} {_unit_name(src, value)} in {UNITS[dst]['plural']}?"
    return question, _fmt(result), _pick_distinct(rng, wrong, _fmt(result))


def _sampled(
    rng: random.Random, make: Callable[[random.Random, str], Draft]
) -> dict[str, list[Draft]]:
    """PER_CELL drafts with distinct questions for each difficulty, from a random generator."""
    out: dict[str, list[Draft]] = {}
    seen: set[str] = set()
    for level in DIFFICULTIES:
        out[level] = []
        while len(out[level]) < PER_CELL:
            draft = make(rng, level)
            if draft[0] not in seen:
                seen.add(draft[0])
                out[level].append(draft)
    return out


def build_mcqa_items(seed: int = 0) -> list[dict]:
    """Four-option questions: 48 per (subject, difficulty), answer positions balanced."""
    builders: dict[str, Callable[[random.Random], dict[str, list[Draft]]]] = {
        "geography": _geography,
        "chemistry": _chemistry,
        "biology": _biology,
        "arithmetic": lambda rng: _sampled(rng, _arithmetic_draft),
        "units": lambda rng: _sampled(rng, _units_draft),
    }
    items: list[dict] = []
    for subject in SUBJECTS:
        # One stream per subject, so editing one subject's templates leaves the others' bytes.
        rng = random.Random(f"mcqa-{subject}-{seed}")
        drafts = builders[subject](rng)
        cells = [(level, d) for level in DIFFICULTIES for d in drafts[level][:PER_CELL]]
        assert all(len(drafts[level]) == PER_CELL for level in DIFFICULTIES), subject
        # Exactly balanced answer positions within each subject, in a seeded order.
        positions = [i % 4 for i in range(len(cells))]
        rng.shuffle(positions)
        rng.shuffle(cells)
        for n, ((level, (question, answer, wrong)), pos) in enumerate(
            zip(cells, positions, strict=True)
        ):
            choices = rng.sample(wrong, len(wrong))
            choices.insert(pos, answer)
            assert len(set(choices)) == 4, (question, choices)
            items.append(
                {
                    "id": f"mcqa-{subject}-{n}",
                    "question": question,
                    "choices": choices,
                    "answer": pos,
                    "source": "demo",
                    "subject": subject,
                    "difficulty": level,
                }
            )
    questions = [it["question"] for it in items]
    assert len(set(questions)) == len(questions), "duplicate MCQA question"
    return items


# --------------------------------------------------------------------------- open-ended QA

# The offline stand-in for the paper's generative shift (train PopQA, test TriviaQA): the demo
# MCQA questions asked without options, trained on three subjects and tested on the other two.
OPENQA_TRAIN_SUBJECTS = ("chemistry", "units", "arithmetic")
OPENQA_TEST_SUBJECTS = ("geography", "biology")
OPENQA_HELDOUT = Fraction(1, 3)  # of the training subjects' questions
ANSWER_ALIASES = {
    "United States": ["USA", "United States of America", "US", "America"],
    "United Kingdom": ["UK", "Britain", "Great Britain"],
    "Czech Republic": ["Czechia"],
    "United Arab Emirates": ["UAE"],
    "the mitochondrion": ["mitochondria"],
    "red blood cells": ["erythrocytes"],
}


def openqa_answers(answer: str) -> list[str]:
    """The gold answer and the other spellings a grader should accept."""
    answers = [answer, *ANSWER_ALIASES.get(answer, [])]
    singular = {plural: group for group, plural in facts.GROUP_PLURALS.items()}
    if answer in singular:
        answers.append(singular[answer])
    if answer.isdigit() and int(answer) < len(NUMBER_WORDS):
        answers.append(NUMBER_WORDS[int(answer)])
    return list(dict.fromkeys(answers))


def build_openqa_splits(mcqa_items: Sequence[dict], seed: int = 0) -> dict[str, list[dict]]:
    """Open questions (MCQA questions without options that make sense alone) split by subject:
    train / held-out from OPENQA_TRAIN_SUBJECTS, test from OPENQA_TEST_SUBJECTS."""
    rows = {"train": [], "test": []}
    for item in mcqa_items:
        if item["question"].startswith("Which of these"):  # needs its options
            continue
        part = "test" if item["subject"] in OPENQA_TEST_SUBJECTS else "train"
        rows[part].append(
            {
                "id": item["id"].replace("mcqa-", "openqa-", 1),
                "question": item["question"],
                "answers": openqa_answers(item["choices"][item["answer"]]),
                "source": "demo",
                "subject": item["subject"],
            }
        )
    rng = random.Random(f"openqa-{seed}")
    rng.shuffle(rows["train"])
    rng.shuffle(rows["test"])
    n_heldout = int(len(rows["train"]) * OPENQA_HELDOUT)
    return {
        "train": rows["train"][n_heldout:],
        "heldout": rows["train"][:n_heldout],
        "test": rows["test"],
    }


# --------------------------------------------------------------------------- instructions


def _inline_or_input(
    rng: random.Random, inline: Sequence[str], with_input: Sequence[str], value: str, output: str
) -> Row:
    """Half the time the task is spelled out in the instruction, half the time in `input`."""
    if rng.random() < 0.5:
        return rng.choice(inline), "", output
    return rng.choice(with_input), value, output


def _geo_rows(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    for c in rng.sample(COUNTRIES, 50):
        the, capital = _the(c["name"]), c["capital"]
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"What is the capital of {the}?",
                    f"Name the capital city of {the}.",
                    f"Which city is the capital of {the}?",
                ],
                [
                    "What is the capital of the given country?",
                    "Name the capital city of this country.",
                ],
                c["name"],
                f"The capital of {the} is {capital}.",
            )
        )
    for c in rng.sample(COUNTRIES, 25):
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"{c['capital']} is the capital of which country?",
                    f"Which country has {c['capital']} as its capital?",
                ],
                ["Name the country whose capital is the given city."],
                c["capital"],
                f"{c['capital']} is the capital of {_the(c['name'])}.",
            )
        )
    for c in rng.sample([c for c in COUNTRIES if c["continent"] != "Oceania"], 35):
        the = _the(c["name"])
        rows.append(
            _inline_or_input(
                rng,
                [f"On which continent is {the}?", f"Which continent is {the} in?"],
                ["On which continent is the given country?", "Name the continent of this country."],
                c["name"],
                f"{_cap(the)} is in {c['continent']}.",
            )
        )
    for c in rng.sample(COUNTRIES, 25):
        the = _the(c["name"])
        where = "in the Oceania region" if c["continent"] == "Oceania" else f"in {c['continent']}"
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"Write one sentence about {the}.",
                    f"Tell me briefly where {the} is and what its capital is.",
                ],
                ["Write a short factual sentence about the given country."],
                c["name"],
                f"{_cap(the)} is a country {where}, and its capital is {c['capital']}.",
            )
        )
    return rows


def _chem_rows(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    for e in rng.sample(ELEMENTS, 35):
        out = f"The chemical symbol for {e['name']} is {e['symbol']}."
        if e["origin"]:
            out += f" The symbol comes from {e['origin']}."
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"What is the chemical symbol for {e['name']}?",
                    f"Give the chemical symbol of {e['name']}.",
                ],
                [
                    "Give the chemical symbol of the given element.",
                    "What is this element's symbol?",
                ],
                e["name"],
                out,
            )
        )
    for e in rng.sample(ELEMENTS, 20):
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"Which element has the symbol {e['symbol']}?",
                    f"What element does the symbol {e['symbol']} stand for?",
                ],
                ["Name the element with the given chemical symbol."],
                e["symbol"],
                f"The symbol {e['symbol']} stands for {e['name']}.",
            )
        )
    for e in rng.sample(ELEMENTS, 30):
        protons = "1 proton" if e["z"] == 1 else f"{e['z']} protons"
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"What is the atomic number of {e['name']}?",
                    f"How many protons does an atom of {e['name']} have?",
                ],
                ["State the atomic number of the given element."],
                e["name"],
                f"{_cap(e['name'])} has atomic number {e['z']}, so each {e['name']} atom has "
                f"{protons} in its nucleus.",
            )
        )
    for e in rng.sample(ELEMENTS, 25):
        out = (
            f"{_cap(e['name'])} is a chemical element with the symbol {e['symbol']} and "
            f"atomic number {e['z']}."
        )
        if e["name"] in facts.NOBLE_GASES:
            out += " It is a noble gas, so it is very unreactive."
        elif e["origin"]:
            out += f" Its symbol comes from {e['origin']}."
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"Describe the element {e['name']} in one or two sentences.",
                    f"Give a short description of {e['name']}.",
                ],
                ["Briefly describe the given chemical element."],
                e["name"],
                out,
            )
        )
    return rows


def _bio_rows(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    groups = ", ".join(facts.ANIMAL_GROUPS[:-1]) + " or " + facts.ANIMAL_GROUPS[-1]
    for a in rng.sample(ANIMALS, 50):
        out = f"{_cap(_an(a['name']))} is {_an(a['group'])}."
        if a["name"] in facts.ANIMAL_NOTES:
            out += " " + facts.ANIMAL_NOTES[a["name"]]
        rows.append(
            _inline_or_input(
                rng,
                [
                    f"Is {_an(a['name'])} a {groups}?",
                    f"Which group of animals does the {a['name']} belong to?",
                ],
                [f"Classify the animal as a {groups}.", "Which group of animals is this?"],
                a["name"],
                out,
            )
        )
    for a in rng.sample(ANIMALS, 25):
        plural = facts.GROUP_PLURALS[a["group"]]
        out = f"{_cap(_an(a['name']))} is {_an(a['group'])}. "
        out += facts.ANIMAL_NOTES.get(
            a["name"], f"{_cap(plural)} {facts.GROUP_TRAITS[a['group']]}."
        )
        rows.append(
            _inline_or_input(
                rng,
                [f"Explain why {_an(a['name'])} is classified as {_an(a['group'])}."],
                ["Explain which group of animals the given animal belongs to, and why."],
                a["name"],
                out,
            )
        )
    for question, _, _, _, statement in facts.BIOLOGY_FACTS:
        if not question.startswith("Which of these"):  # needs the options to make sense
            rows.append((question, "", statement))
    return rows


def _planet_rows(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    for name, pos, kind, fact in facts.PLANETS:
        ordinal = ORDINALS[pos - 1]
        rows.append(
            (
                f"Which planet is the {ordinal} from the Sun?",
                "",
                f"{name} is the {ordinal} planet from the Sun.",
            )
        )
        rows.append(
            _inline_or_input(
                rng,
                [f"Tell me about {name} in two sentences."],
                ["Describe the given planet in two sentences."],
                name,
                f"{name} is the {ordinal} planet from the Sun and {_an(kind)}. It is {fact}.",
            )
        )
        rows.append(
            _inline_or_input(
                rng,
                [f"Is {name} a rocky planet, a gas giant or an ice giant?"],
                ["Say whether the given planet is a rocky planet, a gas giant or an ice giant."],
                name,
                f"{name} is {_an(kind)}.",
            )
        )
    names = [p[0] for p in sorted(facts.PLANETS, key=lambda p: p[1])]

    def of_kind(kind: str) -> str:
        return _join([p[0] for p in facts.PLANETS if p[2] == kind])

    rows += [
        (
            "List the planets of the Solar System in order from the Sun.",
            "",
            f"In order from the Sun, the planets are {_join(names)}.",
        ),
        (
            "Name the rocky planets of the Solar System.",
            "",
            f"The rocky planets are {of_kind('rocky planet')}.",
        ),
        (
            "Which planets of the Solar System are gas giants?",
            "",
            f"The gas giants are {of_kind('gas giant')}.",
        ),
        (
            "Which planets of the Solar System are ice giants?",
            "",
            f"The ice giants are {of_kind('ice giant')}.",
        ),
        (
            "How many planets are in the Solar System?",
            "",
            f"There are {len(names)} planets in the Solar System: {_join(names)}.",
        ),
    ]
    return rows


def _arith_row(rng: random.Random, kind: str) -> Row:
    r = rng.randint
    if kind == "basic":
        op = rng.choice("+-×")
        a, b = (r(100, 999), r(2, 99)) if op != "×" else (r(2, 99), r(2, 49))
        ans = {"+": a + b, "-": a - b, "×": a * b}[op]
        expr = f"{a} {op} {b}"
        out = f"{expr} = {ans}."
        return _inline_or_input(
            rng,
            [f"What is {expr}?", f"Calculate {expr}."],
            ["Calculate the following.", "Solve this arithmetic problem and show the result."],
            expr,
            out,
        )
    if kind == "steps":
        if rng.random() < 0.5:
            a, b, c = r(2, 30), r(2, 30), r(2, 12)
            expr = f"({a} + {b}) × {c}"
            out = (
                f"First, {a} + {b} = {a + b}. Then, {a + b} × {c} = {(a + b) * c}. "
                f"So {expr} = {(a + b) * c}."
            )
        else:
            a, b = r(11, 40), r(3, 12)
            c = r(10, min(99, a * b - 1))
            expr = f"{a} × {b} - {c}"
            out = (
                f"Multiplication comes first: {a} × {b} = {a * b}. Then, {a * b} - {c} = "
                f"{a * b - c}. So {expr} = {a * b - c}."
            )
        return _inline_or_input(
            rng,
            [f"Compute {expr} and show your work.", f"Work out {expr} step by step."],
            ["Work out the expression step by step."],
            expr,
            out,
        )
    if kind == "story":
        n, per = r(3, 12), r(4, 24)
        if rng.random() < 0.5:
            return (
                f"A box holds {per} pencils. How many pencils are in {n} boxes?",
                "",
                f"{n} boxes hold {n} × {per} = {n * per} pencils.",
            )
        return (
            f"{n * per} apples are shared equally among {n} children. How many apples does "
            "each child get?",
            "",
            f"Each child gets {n * per} ÷ {n} = {per} apples.",
        )
    if kind == "divide":
        b, q = r(3, 25), r(2, 60)
        expr = f"{b * q} ÷ {b}"
        return _inline_or_input(
            rng,
            [f"What is {expr}?", f"Divide {b * q} by {b}."],
            ["Calculate the following.", "Work out this division."],
            expr,
            f"{b * q} divided by {b} is {q}.",
        )
    if kind == "compare":
        nums = rng.sample(range(1, 200), r(3, 6))
        listed = ", ".join(map(str, nums))
        which = rng.choice(["largest", "smallest", "sum"])
        if which == "sum":
            return _inline_or_input(
                rng,
                [f"What is the sum of {_join([str(n) for n in nums])}?"],
                ["Add up the numbers in the list."],
                listed,
                f"{' + '.join(map(str, nums))} = {sum(nums)}.",
            )
        best = max(nums) if which == "largest" else min(nums)
        return _inline_or_input(
            rng,
            [f"Which is the {which} of the numbers {listed}?"],
            [f"Find the {which} number in the list."],
            listed,
            f"The {which} number is {best}.",
        )
    n = r(11, 999)  # parity
    reason = (
        "it is divisible by 2" if n % 2 == 0 else "it leaves a remainder of 1 when divided by 2"
    )
    return _inline_or_input(
        rng,
        [f"Is {n} even or odd?"],
        ["Say whether the number is even or odd."],
        str(n),
        f"{n} is {'even' if n % 2 == 0 else 'odd'}, because {reason}.",
    )


def _unit_row(rng: random.Random) -> Row:
    src, dst, value, result = _conversion(rng, rng.choice(DIFFICULTIES))
    big, small = (src, dst) if UNITS[src]["size"] > UNITS[dst]["size"] else (dst, src)
    factor = UNITS[big]["size"] / UNITS[small]["size"]
    out = f"{_fmt(value)} {_unit_name(src, value)} is {_fmt(result)} {_unit_name(dst, result)}"
    if value == 1 and src == big:  # the reason would just repeat the answer
        out += "."
    else:
        out += f", because 1 {big} is {_fmt(factor)} {_unit_name(small, factor)}."
    quantity = f"{_fmt(value)} {_unit_name(src, value)}"
    return _inline_or_input(
        rng,
        [
            f"Convert {quantity} to {UNITS[dst]['plural']}.",
            f"How many {UNITS[dst]['plural']} are in {quantity}?",
        ],
        [f"Convert the quantity to {UNITS[dst]['plural']}."],
        quantity,
        out,
    )


def _word_row(rng: random.Random, kind: str) -> Row:
    word = rng.choice(facts.WORDS)
    if kind == "sort":
        nums = rng.sample(range(1, 100), rng.randint(4, 7))
        listed = ", ".join(map(str, nums))
        if rng.random() < 0.5:
            order, ordered = "from smallest to largest", sorted(nums)
        else:
            order, ordered = "from largest to smallest", sorted(nums, reverse=True)
        return _inline_or_input(
            rng,
            [f"Sort the numbers {_join([str(n) for n in nums])} {order}."],
            [f"Sort these numbers {order}."],
            listed,
            f"Sorted {order}, the numbers are {_join([str(n) for n in ordered])}.",
        )
    if kind == "reverse":
        return _inline_or_input(
            rng,
            [f'Reverse the letters of the word "{word}".', f'Spell "{word}" backwards.'],
            ["Write the given word backwards."],
            word,
            f'The word "{word}" spelled backwards is "{word[::-1]}".',
        )
    if kind == "length":
        return _inline_or_input(
            rng,
            [f'How many letters are in the word "{word}"?'],
            ["Count the letters in the given word."],
            word,
            f'The word "{word}" has {len(word)} letters.',
        )
    if kind == "count":
        letter = rng.choice(sorted(set(word)))
        return _inline_or_input(
            rng,
            [f'How many times does the letter "{letter}" appear in the word "{word}"?'],
            [f'Count how many times the letter "{letter}" appears in the given word.'],
            word,
            f'The letter "{letter}" appears {_times(word.count(letter))} in "{word}".',
        )
    plural, rule = _plural(word)
    return _inline_or_input(
        rng,
        [f'What is the plural of "{word}"?', f'Write the plural form of "{word}".'],
        ["Write the plural of the given noun."],
        word,
        f'The plural of "{word}" is "{plural}". {rule}',
    )


def _list_row(rng: random.Random) -> Row:
    n = rng.randint(2, 5)
    category = rng.choice(["noble", "country", "animal", "capital", "one-letter"])
    if category == "noble":
        what, pool = "noble gases", facts.NOBLE_GASES
    elif category == "country":
        continent = rng.choice(facts.CONTINENTS)
        what, pool = (
            f"countries in {continent}",
            [c["name"] for c in COUNTRIES if c["continent"] == continent],
        )
        pool = [_the(p) for p in pool]
    elif category == "animal":
        group = rng.choice(facts.ANIMAL_GROUPS)
        what, pool = facts.GROUP_PLURALS[group], [a["name"] for a in ANIMALS if a["group"] == group]
        # "fish" reads as one animal; name the group explicitly instead.
        what = "kinds of fish" if group == "fish" else what
    elif category == "capital":
        continent = rng.choice([k for k in facts.CONTINENTS if k != "Oceania"])
        what, pool = (
            f"capital cities in {continent}",
            [c["capital"] for c in COUNTRIES if c["continent"] == continent],
        )
    else:
        what, pool = (
            "chemical elements with a one-letter symbol",
            [e["name"] for e in ELEMENTS if len(e["symbol"]) == 1],
        )
    n = min(n, len(pool))
    chosen = rng.sample(pool, n)
    if category == "animal":
        chosen = [f"the {name}" for name in chosen]
    verb = rng.choice(["Name", "List"])
    return (
        f"{verb} {NUMBER_WORDS[n]} {what}.",
        "",
        f"{_cap(NUMBER_WORDS[n])} {what} are {_join(chosen)}.",
    )


def build_instruction_items(seed: int = 0) -> list[dict]:
    """Alpaca-style rows (`instruction`, `input`, `output`), about half with an empty input."""
    rng = random.Random(f"instructions-{seed}")
    rows: list[Row] = []
    rows += _geo_rows(rng) + _chem_rows(rng) + _bio_rows(rng) + _planet_rows(rng)
    # Computed tasks: (maker, how many distinct rows to keep).
    computed: list[tuple[Callable[[random.Random], Row], int]] = [
        (lambda g: _arith_row(g, "basic"), 45),
        (lambda g: _arith_row(g, "steps"), 15),
        (lambda g: _arith_row(g, "story"), 10),
        (lambda g: _arith_row(g, "divide"), 20),
        (lambda g: _arith_row(g, "compare"), 15),
        (lambda g: _arith_row(g, "parity"), 8),
        (_unit_row, 55),
        (lambda g: _word_row(g, "sort"), 30),
        (lambda g: _word_row(g, "reverse"), 25),
        (lambda g: _word_row(g, "length"), 25),
        (lambda g: _word_row(g, "count"), 20),
        (lambda g: _word_row(g, "plural"), 25),
        (_list_row, 20),
    ]
    seen = {(ins, inp) for ins, inp, _ in rows}
    assert len(seen) == len(rows), "duplicate templated instruction"
    for make, count in computed:
        kept = 0
        while kept < count:
            row = make(rng)
            if (row[0], row[1]) not in seen:
                seen.add((row[0], row[1]))
                rows.append(row)
                kept += 1
    assert len(rows) == N_INSTRUCTIONS, len(rows)
    # A sentence that ends in "Washington, D.C." must not get a second full stop.
    return [
        {"instruction": i, "input": x, "output": re.sub(r"\.\.(?=\s|$)", ".", o)}
        for i, x, o in rows
    ]


# --------------------------------------------------------------------------- splits and files


def _apportion(n: int, fractions: Sequence[Fraction]) -> list[int]:
    """Split `n` into integer parts proportional to `fractions` (largest remainder)."""
    exact = [n * f for f in fractions]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _spread_labels(counts: Sequence[int]) -> list[int]:
    """Split labels in an order that spaces each split's picks evenly (systematic sampling)."""
    slots = [(Fraction(2 * k + 1, 2 * c), j) for j, c in enumerate(counts) for k in range(c)]
    return [j for _, j in sorted(slots)]


def split_items(
    items: Sequence[dict],
    fractions: dict[str, float | Fraction],
    seed: int = 0,
    key: str | Callable[[dict], object] | None = None,
    spread: Callable[[dict], object] | None = None,
) -> dict[str, list[dict]]:
    """Deterministic split into `fractions` (name -> share); stratified by `key` when given.

    Each stratum is shuffled and apportioned exactly (largest remainder). With `spread`, items of
    a stratum are ordered by it before being dealt out evenly, so each split also gets its share
    of every `spread` value (e.g. difficulty) up to rounding. Each split is shuffled at the end,
    so that any prefix of it is mixed.
    """
    shares = [Fraction(f).limit_denominator(10**6) for f in fractions.values()]
    if any(s < 0 for s in shares) or abs(sum(shares) - 1) > Fraction(1, 10**6):
        raise ValueError(f"split fractions must be non-negative and sum to 1, got {fractions}")
    get = (lambda it: it[key]) if isinstance(key, str) else key
    rng = random.Random(f"split-{seed}")
    strata: dict[object, list[int]] = {}
    for idx, item in enumerate(items):
        strata.setdefault(get(item) if get else None, []).append(idx)
    names = list(fractions)
    picked: dict[str, list[int]] = {name: [] for name in names}
    for stratum in sorted(strata, key=repr):  # sorted: independent of item order
        idxs = list(strata[stratum])
        rng.shuffle(idxs)
        if spread is not None:
            idxs.sort(key=lambda i: spread(items[i]))  # stable: random order within a value
        labels = _spread_labels(_apportion(len(idxs), shares))
        for idx, label in zip(idxs, labels, strict=True):
            picked[names[label]].append(idx)
    out = {}
    for name, idxs in picked.items():
        rng.shuffle(idxs)
        out[name] = [items[i] for i in idxs]
    return out


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(text, encoding="utf-8", newline="\n")


def write_demo_data(out_dir: Path, seed: int = 0) -> dict[str, int]:
    """Write the nine demo JSON Lines files into `out_dir`; returns rows per file name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mcqa_items = build_mcqa_items(seed)
    splits = {
        # Stratified by subject; difficulty and answer position spread evenly within each.
        "mcqa": split_items(
            mcqa_items,
            MCQA_SPLITS,
            seed,
            key="subject",
            spread=lambda it: (it["difficulty"], it["answer"]),
        ),
        "instructions": split_items(build_instruction_items(seed), INSTRUCTION_SPLITS, seed),
        "openqa": build_openqa_splits(mcqa_items, seed),
    }
    counts = {}
    for prefix, parts in splits.items():
        for split, rows in parts.items():
            name = f"{prefix}_{split}.jsonl"
            _write_jsonl(out_dir / name, rows)
            counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    for file_name, n_rows in write_demo_data(DEMO_DIR).items():
        print(f"{file_name}: {n_rows}")
