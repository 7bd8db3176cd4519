"""The bundled model tiny-capitals: the article's examples, its accuracy, and that it is a real HF checkpoint."""
from __future__ import annotations

import csv
import socket
from pathlib import Path

import pytest
import torch

import llminfer

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "data" / "models" / "tiny-capitals"
CORPUS_DIR = ROOT / "data" / "corpus"
HELD_OUT_GATE = "capital_city"  # the held-out template that must reach 80%


@pytest.fixture(scope="module")
def bundled():
    """(model, tokenizer) of the bundled model on the CPU."""
    return llminfer.load_pretrained("tiny-capitals", device="cpu")


@pytest.fixture(scope="module")
def countries():
    with open(ROOT / "data" / "countries.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def held_out_examples() -> list[tuple[str, str, str]]:
    lines = (CORPUS_DIR / "held_out.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [tuple(line.split("\t")) for line in lines]


@torch.no_grad()
def greedy_matches(model, tokenizer, prompts: list[str], completions: list[str]) -> list[bool]:
    """Whether greedy decoding gives exactly completion + <eos>, checked in one teacher-forced forward per batch.

    Greedy decoding reproduces the completion exactly when, at every position after
    the prompt, the argmax is the next true token; so one forward over
    prompt + completion + <eos> answers for all steps at once.
    """
    eos = tokenizer.eos_token_id
    rows, spans = [], []
    for prompt, completion in zip(prompts, completions):
        prompt_ids, full_ids = tokenizer.encode(prompt), tokenizer.encode(prompt + completion)
        assert full_ids[:len(prompt_ids)] == prompt_ids, f"{prompt!r} is not a token prefix of its sentence"
        rows.append(full_ids + [eos])
        spans.append((len(prompt_ids), len(full_ids) + 1))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])      # (B, T), right-padded
    predicted = model(ids).argmax(-1)                                     # (B, T)
    return [bool((predicted[r, lo - 1:hi - 1] == ids[r, lo:hi]).all()) for r, (lo, hi) in enumerate(spans)]


def generated_text(model, tokenizer, prompt: str) -> tuple[str, list[int]]:
    result = llminfer.generate(model, tokenizer.encode(prompt), max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(result.token_ids), result.token_ids


@pytest.mark.parametrize("prompt, expected", [
    ("The capital of France", " is Paris."),
    ("The capital of France is", " Paris."),
])
def test_article_prompts_decode_greedily_then_stop(bundled, prompt, expected):
    model, tokenizer = bundled
    text, ids = generated_text(model, tokenizer, prompt)
    print(f"\n{prompt!r} -> {tokenizer.tokens(ids)}")
    assert ids[-1] == tokenizer.eos_token_id, f"no end-of-sequence after {text!r}: {tokenizer.tokens(ids)}"
    assert text == expected


def test_capitals_accuracy_training_and_held_out_templates(bundled, countries):
    model, tokenizer = bundled
    prompts = [f"The capital of {row['name_in_sentence']} is" for row in countries]
    completions = [f" {row['capital']}." for row in countries]
    ok = greedy_matches(model, tokenizer, prompts, completions)
    scores = {"The capital of X is": sum(ok) / len(ok)}
    wrong = [p for p, good in zip(prompts, ok) if not good]

    # the teacher-forced check agrees with real greedy generation on a sample of countries
    for i in range(0, len(prompts), 15):
        text, ids = generated_text(model, tokenizer, prompts[i])
        real = text == completions[i] and ids[-1] == tokenizer.eos_token_id
        assert real == ok[i], f"{prompts[i]!r}: generate gave {text!r}, the batched check said {ok[i]}"

    held_out = held_out_examples()
    assert len(held_out) >= len(countries), "data/corpus/held_out.tsv is missing prompts"
    for name in dict.fromkeys(t for t, _, _ in held_out):
        examples = [(p, c) for t, p, c in held_out if t == name]
        matches = greedy_matches(model, tokenizer, [p for p, _ in examples], [c for _, c in examples])
        scores[f"held-out {name}: {examples[0][0]!r}"] = sum(matches) / len(matches)
    print("\naccuracy over", len(countries), "countries:")
    for name, value in scores.items():
        print(f"  {value:6.1%}  {name}")
    print("  wrong with the training template:", wrong)
    assert scores["The capital of X is"] >= 0.95
    gate = next(v for k, v in scores.items() if k.startswith(f"held-out {HELD_OUT_GATE}:"))
    assert gate >= 0.80


def test_held_out_templates_never_appear_in_training_corpus():
    train = (CORPUS_DIR / "train.txt").read_text(encoding="utf-8").splitlines()
    held_out = held_out_examples()
    templates = {t: p for t, p, _ in held_out}
    assert "capital_city" in templates
    train_set = set(train)
    assert not [p + c for _, p, c in held_out if p + c in train_set]
    # no training sentence even starts the way the gated held-out template does
    assert not [s for s in train if s.startswith("The capital city of")]


def test_loads_in_transformers_with_matching_logits(bundled):
    import transformers  # a test dependency, always installed by make test
    model, tokenizer = bundled
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    texts = ["The capital of France is", "I love AI", "Paris is the capital of the Netherlands? No."]
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            ours = model(ids)
            theirs = reference(input_ids=ids).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))
    assert hf_tokenizer("The capital of France is")["input_ids"] == tokenizer.encode("The capital of France is")
    assert hf_tokenizer.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id


@pytest.mark.parametrize("text, pieces", [
    ("The capital of France is", ["The", "capital", "of", "France", "is"]),
    ("I love AI", ["I", "love", "AI"]),
])
def test_tokenizer_splits_article_prompts(bundled, text, pieces):
    _, tokenizer = bundled
    ids = tokenizer.encode(text)
    assert [piece.strip() for piece in tokenizer.tokens(ids)] == pieces
    assert tokenizer.tokens(ids)[1:] == [" " + p for p in pieces[1:]]   # the space belongs to the word after it
    assert tokenizer.bos_token_id not in ids                            # prompts carry no BOS


@pytest.mark.parametrize("text", ["The capital of Côte d'Ivoire is Yamoussoukro.", "São Tomé, Reykjavík & 42!",
                                  "  two  spaces\tand a tab", "I love AI."])
def test_tokenizer_round_trips_text(bundled, text):
    _, tokenizer = bundled
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_loads_by_name_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted while loading the bundled model")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert "tiny-capitals" in llminfer.bundled_models()
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu")
    assert model.config.n_kv_heads < model.config.n_heads                # grouped-query attention
    assert tokenizer.eos_token_id is not None and tokenizer.bos_token_id is not None
    text, _ = generated_text(model, tokenizer, "The capital of France is")
    assert text == " Paris."


def test_checkpoint_is_small_float32_safetensors():
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 10 * 10**6
    from safetensors import safe_open
    with safe_open(str(weights), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F32"}
    for name in ("config.json", "generation_config.json", "tokenizer.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), f"{name} is missing from {MODEL_DIR}"
