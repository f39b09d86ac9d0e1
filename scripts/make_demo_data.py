"""Write hetero/data/demo_alpaca.jsonl: a small, deterministic instruction data set for demos and tests.

Every record is generated here from simple rules (arithmetic, unit conversions, string tasks, a
small capitals table), so the set is reproducible and carries no third-party text:

    python scripts/make_demo_data.py            # rewrites the bundled file
    python scripts/make_demo_data.py --check    # exits 1 if the bundled file is stale
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "hetero" / "data" / "demo_alpaca.jsonl"
SEED = 1234
PER_TASK = 30

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Egypt": "Cairo",
    "Kenya": "Nairobi", "India": "New Delhi", "China": "Beijing", "Mexico": "Mexico City", "Peru": "Lima",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Ireland": "Dublin", "Austria": "Vienna", "Chile": "Santiago", "Argentina": "Buenos Aires",
    "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Morocco": "Rabat", "Ghana": "Accra",
    "Cuba": "Havana",
}
WORDS = [
    "apple", "river", "pipeline", "tensor", "garden", "planet", "window", "rocket", "silver", "lantern",
    "kernel", "market", "orange", "bridge", "forest", "engine", "marble", "canvas", "signal", "harbor",
    "pencil", "summer", "thunder", "velvet", "meadow", "copper", "falcon", "galaxy", "island", "journey",
]
# (from unit, to unit, factor, decimals)
UNITS = [
    ("kilometers", "meters", 1000.0, 0), ("meters", "centimeters", 100.0, 0), ("kilograms", "grams", 1000.0, 0),
    ("hours", "minutes", 60.0, 0), ("minutes", "seconds", 60.0, 0), ("miles", "kilometers", 1.609344, 2),
    ("inches", "centimeters", 2.54, 2), ("pounds", "kilograms", 0.45359237, 2), ("liters", "milliliters", 1000.0, 0),
    ("gigabytes", "megabytes", 1000.0, 0),
]

Record = dict[str, str]


def _rec(instruction: str, output: str, input_: str = "") -> Record:
    return {"instruction": instruction, "input": input_, "output": output}


def addition(rng: random.Random) -> Record:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return _rec(f"What is {a} plus {b}?", f"{a} + {b} = {a + b}.")


def subtraction(rng: random.Random) -> Record:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return _rec("Subtract the second number from the first.", f"{a} - {b} = {a - b}.", f"{a}, {b}")


def multiplication(rng: random.Random) -> Record:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return _rec(f"Multiply {a} by {b}.", f"{a} x {b} = {a * b}.")


def units(rng: random.Random) -> Record:
    src, dst, factor, decimals = rng.choice(UNITS)
    value = rng.randint(1, 500)
    result = value * factor
    shown = f"{result:.{decimals}f}" if decimals else str(int(round(result)))
    return _rec(f"Convert {value} {src} to {dst}.", f"{value} {src} is {shown} {dst}.")


def reverse(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return _rec("Reverse the letters of the word.", word[::-1], word)


def capital(rng: random.Random) -> Record:
    country = rng.choice(sorted(CAPITALS))
    return _rec(f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}.")


def sort_numbers(rng: random.Random) -> Record:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 7))]
    return _rec(
        "Sort these numbers from smallest to largest.",
        ", ".join(map(str, sorted(numbers))),
        ", ".join(map(str, numbers)),
    )


def count_letters(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    n = word.count(letter)
    return _rec(
        f"How many times does the letter '{letter}' appear in the word?",
        f"The letter '{letter}' appears {n} time{'s' if n != 1 else ''} in '{word}'.",
        word,
    )


def uppercase(rng: random.Random) -> Record:
    words = rng.sample(WORDS, rng.randint(2, 4))
    text = " ".join(words)
    return _rec("Rewrite the text in upper case.", text.upper(), text)


def parity(rng: random.Random) -> Record:
    n = rng.randint(0, 10_000)
    return _rec(f"Is {n} even or odd?", f"{n} is {'even' if n % 2 == 0 else 'odd'}.")


TASKS: list[Callable[[random.Random], Record]] = [
    addition, subtraction, multiplication, units, reverse, capital, sort_numbers, count_letters, uppercase, parity,
]


def generate(seed: int = SEED, per_task: int = PER_TASK) -> list[Record]:
    """All records, interleaved across tasks, in a fixed order for a given seed."""
    rng = random.Random(seed)
    records = [task(rng) for _ in range(per_task) for task in TASKS]
    rng.shuffle(records)
    return records


def render(records: list[Record]) -> str:
    """The JSONL text (stable key order, ASCII, trailing newline)."""
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the bundled demo file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the bundled file differs")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render(generate())
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python scripts/make_demo_data.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {len(text.splitlines())} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
