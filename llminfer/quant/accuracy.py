"""What quantization costs on a whole task: capitals answered, KL divergence from float, bytes. Chapter 08.

The bundled model knows the capital of each of the 195 countries in data/countries.csv. A quantized copy
either still answers "The capital of X is" with exactly " <capital>." and the end token (greedy, checked in
one teacher-forced forward), or it does not. The KL divergence of its next-token distributions from the
float model's, averaged over every position of the held-out sentences of data/corpus, measures the damage
before it flips an answer.
"""
from __future__ import annotations

import copy
import csv
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .linear import quantize, quantized_weight_bytes

__all__ = ["data_dir", "load_countries", "load_held_out", "capitals_correct", "kl_from_reference",
           "FormatResult", "evaluate_format"]


def data_dir() -> Path:
    """The repository's data/ folder (countries and corpus); FileNotFoundError if this is not a clone."""
    folder = Path(__file__).resolve().parents[2] / "data"
    if not (folder / "countries.csv").is_file():
        raise FileNotFoundError(f"no data/countries.csv beside the package (looked in {folder}); the accuracy "
                                "study reads the repository's data/ folder, so run it from a clone")
    return folder


def load_countries() -> list[dict]:
    """The 195 rows of data/countries.csv (country, name_in_sentence, capital, ...). Chapter 08."""
    with open(data_dir() / "countries.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def load_held_out() -> list[str]:
    """The held-out sentences of data/corpus/held_out.tsv, prompt and completion joined. Chapter 08."""
    lines = (data_dir() / "corpus" / "held_out.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [prompt + completion for _, prompt, completion in (line.split("\t") for line in lines if line)]


def _padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool, device=device)
    return ids, mask                     # right padding: a causal model never looks at it from real tokens


@torch.inference_mode()
def capitals_correct(model, tokenizer, countries: list[dict] | None = None) -> list[bool]:
    """Whether greedy decoding of 'The capital of X is' gives exactly ' <capital>.' then <eos>, per country."""
    countries = load_countries() if countries is None else countries
    rows, spans = [], []
    for row in countries:
        prompt = f"The capital of {row['name_in_sentence']} is"
        p, full = tokenizer.encode(prompt), tokenizer.encode(f"{prompt} {row['capital']}.")
        rows.append(full + [tokenizer.eos_token_id])
        spans.append((len(p), len(full) + 1))
    ids, _ = _padded(rows, model.device)
    predicted = model(ids).argmax(-1)                                         # (B, T)
    return [bool((predicted[i, lo - 1:hi - 1] == ids[i, lo:hi]).all()) for i, (lo, hi) in enumerate(spans)]


@torch.inference_mode()
def kl_from_reference(reference, model, tokenizer, sentences: list[str] | None = None) -> float:
    """Mean KL(reference ‖ model) of next-token distributions, nats per token, over every position."""
    sentences = load_held_out() if sentences is None else sentences
    ids, mask = _padded([tokenizer.encode(s) for s in sentences], reference.device)
    log_p = F.log_softmax(reference(ids).float(), dim=-1)                     # (B, T, vocab)
    log_q = F.log_softmax(model(ids).float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)                              # (B, T)
    return float(kl[mask].mean())


@dataclass
class FormatResult:
    """One row of the accuracy table. Chapter 08."""
    scheme: str
    group_size: int | None
    correct: int
    total: int
    kl: float
    weight_bytes: int

    @property
    def label(self) -> str:
        return f"{self.scheme} {'per channel' if self.group_size is None else f'g{self.group_size}'}"


def evaluate_format(model, tokenizer, scheme: str | None, group_size: int | None = None,
                    countries: list[dict] | None = None, sentences: list[str] | None = None) -> FormatResult:
    """Quantizes a copy of model (scheme None: the float model itself) and scores it. Chapter 08."""
    candidate = model if scheme is None else quantize(copy.deepcopy(model), scheme, group_size)
    ok = capitals_correct(candidate, tokenizer, countries)
    kl = 0.0 if scheme is None else kl_from_reference(model, candidate, tokenizer, sentences)
    name = str(model.dtype).removeprefix("torch.") if scheme is None else scheme
    return FormatResult(name, group_size, sum(ok), len(ok), kl, quantized_weight_bytes(candidate))
