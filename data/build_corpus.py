"""Build the training corpus of the bundled model from data/countries.csv.

Run `python data/build_corpus.py` to write data/corpus/train.txt (one training
sentence per line) and data/corpus/held_out.tsv (prompt, expected completion)
for phrasings the model never sees. `make model` calls this through
data/build_model.py.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
COUNTRIES_CSV = DATA_DIR / "countries.csv"
CORPUS_DIR = DATA_DIR / "corpus"

# Sentence templates the model is trained on. {country} is the name as it is
# written inside a sentence ("the Netherlands"), {Country} the same at the
# start of a sentence ("The Netherlands").
TRAIN_TEMPLATES = [
    "The capital of {country} is {capital}.",
    "{capital} is the capital of {country}.",
    "{Country} has its capital in {capital}.",
    "In {country}, the capital is {capital}.",
    "What is the capital of {country}? It is {capital}.",
    "{capital} is a city in {country}.",
    "The government of {country} sits in {capital}.",
    "{Country} is a country in {continent}.",
]

# Phrasings kept out of training (and out of the tokenizer's corpus), used to
# test whether the model's knowledge carries over to a sentence it never saw.
# Each is (prompt, completion); the model should continue the prompt with
# the completion and then end the sequence.
HELD_OUT_TEMPLATES = {
    "capital_city": ("The capital city of {country} is", " {capital}."),
    "possessive": ("{Country}'s capital is", " {capital}."),
    "called": ("The capital of {country} is called", " {capital}."),
}

# The handbook's own sentences: the examples of the source article and the
# vocabulary the chapters use around them.
HANDBOOK_SENTENCES = [
    "The capital of France is Paris.",
    "I love AI.",
    "I love AI and I love Paris.",
    "We love AI.",
    "You love AI.",
    "AI is fun.",
    "AI helps people.",
    "People use AI every day.",
    "The model reads the prompt.",
    "The model reads the whole prompt at once.",
    "The model predicts the next token.",
    "The model writes one token at a time.",
    "A token is a small piece of text.",
    "A token can be a word or a part of a word.",
    "Prefill reads the prompt in one forward pass.",
    "Decode makes one new token at a time.",
    "The first token comes after prefill.",
    "The cache keeps the keys and the values.",
    "The cache saves work.",
    "Each token has a key and a value.",
    "Attention mixes the values.",
    "Attention compares the query with each key.",
    "The query asks what the token is looking for.",
    "The key tells what the token contains.",
    "The value is what the token passes on.",
    "Softmax turns scores into weights.",
    "The weights add up to one.",
    "The model stops at the end of the sequence.",
    "Inference turns a prompt into an answer.",
    "Fast inference makes a good product.",
    "A large language model reads tokens.",
    "A short prompt is fast to read.",
    "A long answer takes many steps.",
    "Memory holds the weights and the cache.",
]
HANDBOOK_REPEATS = 8

SUBJECTS = [
    "The cat", "The dog", "A bird", "My friend", "The teacher", "The farmer",
    "The child", "Our neighbour", "The old man", "A young girl", "The baker",
    "My sister", "My brother", "The doctor", "The student", "Anna", "Tom",
    "Maria", "Omar", "Lena", "Ken", "The pilot", "The driver", "Grandma",
]
INTRANSITIVE = [
    "sleeps", "runs", "sings", "laughs", "waits", "dances", "swims", "smiles",
    "reads", "walks", "cooks", "works", "rests", "plays", "sits",
]
TRANSITIVE = [
    "reads a book", "eats an apple", "drinks tea", "opens the door",
    "writes a letter", "plays the piano", "paints the fence", "bakes bread",
    "feeds the cat", "cleans the room", "waters the plants", "buys some milk",
    "finds a key", "fixes the bike", "visits the market", "carries a bag",
    "watches the rain", "draws a map", "calls a friend", "learns a song",
]
PLACES = [
    "in the garden", "at home", "near the river", "on the hill", "by the sea",
    "every morning", "after lunch", "in the park", "at school", "in the kitchen",
    "on Sunday", "at night", "in the rain", "before dinner", "with a smile",
]
LIKES = [
    "music", "books", "tea", "coffee", "rain", "snow", "cats", "dogs", "maps",
    "bread", "apples", "stories", "trains", "the sea", "the mountains",
]
PRONOUNS = ["I", "We", "You", "They"]
SIMPLE_FACTS = [
    "The sky is blue.", "Grass is green.", "Snow is white.", "The sun is hot.",
    "Ice is cold.", "Water is wet.", "Fire is hot.", "The moon is bright.",
    "A week has seven days.", "A year has twelve months.", "A day has many hours.",
    "Birds can fly.", "Fish can swim.", "Cats like milk.", "Dogs like to run.",
    "The earth goes around the sun.", "Rain falls from the clouds.",
    "Trees grow from seeds.", "Bees make honey.", "Cows give milk.",
]
NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
    "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
    "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
N_GRAMMAR_SENTENCES = 1200


def load_countries(path: Path = COUNTRIES_CSV) -> list[dict[str, str]]:
    """Return the rows of countries.csv (country, name_in_sentence, capital, continent, note)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if None in row:
            raise ValueError(f"countries.csv row {row!r} has more fields than the header; "
                             "put double quotes around a value that contains a comma")
        if not row["name_in_sentence"] or not row["capital"]:
            raise ValueError(f"countries.csv row {row!r} has an empty name or capital; fill it in")
    return rows


def fill(template: str, row: dict[str, str]) -> str:
    """Return one template filled with one country's facts."""
    name = row["name_in_sentence"]
    return template.format(
        country=name,
        Country=name[0].upper() + name[1:],
        capital=row["capital"],
        continent=row["continent"],
    )


def country_sentences(rows: list[dict[str, str]]) -> list[str]:
    """Return every training template filled for every country."""
    return [fill(t, row) for row in rows for t in TRAIN_TEMPLATES]


def held_out_examples(rows: list[dict[str, str]]) -> list[tuple[str, str, str]]:
    """Return (template name, prompt, completion) for every held-out template and country."""
    return [
        (name, fill(prompt, row), fill(completion, row))
        for name, (prompt, completion) in HELD_OUT_TEMPLATES.items()
        for row in rows
    ]


def grammar_sentences(rng: random.Random, n: int = N_GRAMMAR_SENTENCES) -> list[str]:
    """Return n distinct varied short sentences drawn from a small grammar."""
    sentences: set[str] = set()
    while len(sentences) < n:
        kind = rng.randrange(6)
        if kind == 0:
            s = f"{rng.choice(SUBJECTS)} {rng.choice(INTRANSITIVE)} {rng.choice(PLACES)}."
        elif kind == 1:
            s = f"{rng.choice(SUBJECTS)} {rng.choice(TRANSITIVE)}."
        elif kind == 2:
            s = f"{rng.choice(SUBJECTS)} {rng.choice(TRANSITIVE)} {rng.choice(PLACES)}."
        elif kind == 3:
            s = f"{rng.choice(PRONOUNS)} {rng.choice(['like', 'love', 'enjoy'])} {rng.choice(LIKES)}."
        elif kind == 4:
            a, b = rng.randrange(11), rng.randrange(11)
            s = f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
        else:
            i = rng.randrange(len(DAYS))
            s = f"{DAYS[i]} comes before {DAYS[(i + 1) % len(DAYS)]}."
        sentences.add(s)
    return sorted(sentences)


def build_corpus(seed: int = 0) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Return (training sentences, held-out examples); the same seed gives the same corpus."""
    rng = random.Random(seed)
    rows = load_countries()
    train = country_sentences(rows)
    train += HANDBOOK_SENTENCES * HANDBOOK_REPEATS
    train += SIMPLE_FACTS * 2
    train += grammar_sentences(rng)
    rng.shuffle(train)
    held_out = held_out_examples(rows)
    seen = set(train)
    leaked = [prompt for _, prompt, completion in held_out if prompt + completion in seen]
    if leaked:
        raise ValueError(f"held-out sentences appear in the training corpus: {leaked[:3]}; change the templates")
    return train, held_out


def write_corpus(seed: int = 0, out_dir: Path = CORPUS_DIR) -> tuple[Path, Path]:
    """Write train.txt and held_out.tsv under out_dir; return their paths."""
    train, held_out = build_corpus(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, held_out_path = out_dir / "train.txt", out_dir / "held_out.tsv"
    train_path.write_text("\n".join(train) + "\n", encoding="utf-8")
    lines = ["template\tprompt\tcompletion"] + ["\t".join(ex) for ex in held_out]
    held_out_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return train_path, held_out_path


def read_corpus(out_dir: Path = CORPUS_DIR) -> tuple[list[str], list[tuple[str, str, str]]]:
    """Return (training sentences, held-out examples) as written by write_corpus."""
    train = (out_dir / "train.txt").read_text(encoding="utf-8").splitlines()
    rows = (out_dir / "held_out.tsv").read_text(encoding="utf-8").splitlines()[1:]
    held_out = [tuple(line.split("\t")) for line in rows]
    return train, held_out  # type: ignore[return-value]


if __name__ == "__main__":
    train_path, held_out_path = write_corpus()
    train, held_out = read_corpus()
    print(f"wrote {train_path} ({len(train)} sentences) and {held_out_path} ({len(held_out)} prompts)")
