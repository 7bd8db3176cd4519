"""Rebuild the bundled model data/models/tiny-capitals from scratch: corpus, tokenizer, weights, model card.

`make model` runs this. Everything is seeded, so a rebuild gives the same greedy
outputs (the weights themselves may differ in the last bits between machines).
Training uses llminfer's own Transformer on one CPU thread.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DATA_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(DATA_DIR))
sys.path.insert(0, str(DATA_DIR.parent))

import llminfer  # noqa: E402
from build_corpus import load_countries, read_corpus, write_corpus  # noqa: E402
from build_tokenizer import MODEL_DIR, write_tokenizer  # noqa: E402
from model_card import write_model_card  # noqa: E402

SEED = 0
# One thread: on a shared 2-core machine two threads measured 5-25x slower per step than one
# (they wait on each other while other jobs hold the cores), and one thread fixes the order of
# every floating-point sum, so rebuilds agree across machines.
THREADS = 1
# A small Llama-family shape: 4 layers, grouped-query attention (4 query heads share 2 K/V heads).
SHAPE = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384, max_seq_len=128)
STEPS = 3000
BATCH_SIZE = 32
PEAK_LR = 3e-3
WARMUP_STEPS = 100
FINAL_LR_FRACTION = 0.05
WEIGHT_DECAY = 0.01
EVAL_EVERY = 500
# Greedy outputs recorded in the model card: the article's two prompts, then a few that show the limits.
EXAMPLE_PROMPTS = ["The capital of France", "The capital of France is", "I love", "Paris is the capital of",
                   "The capital city of Peru is", "The capital of France is called", "The capital of Atlantis is"]


def seed_everything(seed: int = SEED) -> None:
    """Seed Python and torch and ask torch for deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def learning_rate(step: int, total_steps: int) -> float:
    """Linear warmup to PEAK_LR, then cosine decay to FINAL_LR_FRACTION · PEAK_LR."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return PEAK_LR * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(sequences: list[list[int]], batch_size: int, generator: torch.Generator):
    """Yield index lists forever: shuffled, then grouped by similar length so little is padding."""
    while True:
        order = torch.randperm(len(sequences), generator=generator).tolist()
        pool = batch_size * 16
        epoch: list[list[int]] = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start:start + pool], key=lambda i: len(sequences[i]))
            epoch += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        for k in torch.randperm(len(epoch), generator=generator).tolist():
            yield epoch[k]


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """(B, T) LongTensor of rows right-padded with pad_id."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)


@torch.no_grad()
def exact_match(model, tokenizer, prompts: list[str], completions: list[str]) -> list[bool]:
    """Whether greedy decoding turns each prompt into exactly completion + <eos>.

    Teacher-forced: one forward over prompt + completion + <eos>; the greedy
    output equals the completion exactly when every argmax after the prompt
    matches the next true token.
    """
    eos = tokenizer.eos_token_id
    results: list[bool] = []
    for start in range(0, len(prompts), 256):
        rows, spans = [], []
        for prompt, completion in zip(prompts[start:start + 256], completions[start:start + 256]):
            p, c = tokenizer.encode(prompt), tokenizer.encode(prompt + completion)
            if c[:len(p)] != p:
                raise ValueError(f"{prompt!r} does not tokenize as a prefix of {prompt + completion!r}")
            rows.append(c + [eos])
            spans.append((len(p), len(c) + 1))
        ids = pad(rows, 0)
        predicted = model(ids).argmax(-1)                                # (B, T)
        for r, (lo, hi) in enumerate(spans):
            results.append(bool((predicted[r, lo - 1:hi - 1] == ids[r, lo:hi]).all()))
    return results


def evaluate(model, tokenizer, rows, held_out) -> dict[str, float]:
    """Accuracy of "The capital of X is" and of each held-out template, as fractions."""
    model.eval()
    prompts = [f"The capital of {r['name_in_sentence']} is" for r in rows]
    scores = {"train_template": sum(exact_match(model, tokenizer, prompts, [f" {r['capital']}." for r in rows]))
              / len(rows)}
    for name in dict.fromkeys(t for t, _, _ in held_out):
        examples = [(p, c) for t, p, c in held_out if t == name]
        ok = exact_match(model, tokenizer, [p for p, _ in examples], [c for _, c in examples])
        scores[name] = sum(ok) / len(ok)
    model.train()
    return scores


def train(sentences: list[str], tokenizer, rows, held_out, steps: int = STEPS) -> tuple[llminfer.Transformer, dict]:
    """Train the model on sentence + <eos> sequences (no BOS) and return it with a training log."""
    config = llminfer.ModelConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **SHAPE)
    model = llminfer.Transformer(config).init_weights(SEED)
    model.train()
    sequences = [tokenizer.encode(s) + [tokenizer.eos_token_id] for s in sentences]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=PEAK_LR, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(SEED)
    stream = batches(sequences, BATCH_SIZE, generator)
    log: dict = {"losses": [], "evals": []}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    running = None
    for step in range(steps):
        ids = pad([sequences[i] for i in next(stream)], 0)              # (B, T)
        targets = ids[:, 1:].masked_fill(ids[:, 1:] == 0, -100)       # (B, T-1); padding is not scored
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        logits = model(ids[:, :-1])                                      # (B, T-1, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % 100 == 0:
            log["losses"].append((step + 1, round(running, 4)))
            print(f"step {step + 1:5d}  loss {running:.4f}  wall {time.perf_counter() - wall0:6.1f}s", flush=True)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            scores = evaluate(model, tokenizer, rows, held_out)
            log["evals"].append({"step": step + 1, **{k: round(v, 4) for k, v in scores.items()}})
            print("  accuracy", {k: f"{v:.1%}" for k, v in scores.items()}, flush=True)
    log["train_wall_s"] = time.perf_counter() - wall0
    log["train_cpu_s"] = time.process_time() - cpu0
    model.eval()
    return model, log


def main() -> None:
    """Rebuild corpus, tokenizer, weights and model card; print what was measured."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help=f"model folder (default {MODEL_DIR})")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"CPU threads (default {THREADS})")
    args = parser.parse_args()
    out = args.out
    seed_everything()
    torch.set_num_threads(args.threads)
    write_corpus(SEED)
    sentences, held_out = read_corpus()
    tokenizer_path = write_tokenizer(sentences, out)
    tokenizer = llminfer.Tokenizer.from_file(tokenizer_path)
    rows = load_countries()
    model, log = train(sentences, tokenizer, rows, held_out, args.steps)
    llminfer.save_pretrained(model, out, tokenizer=tokenizer)
    # reload what was written and measure that, as a user would get it
    loaded, loaded_tokenizer = llminfer.load_pretrained(out, device="cpu")
    scores = evaluate(loaded, loaded_tokenizer, rows, held_out)
    examples = {}
    for prompt in EXAMPLE_PROMPTS:
        result = llminfer.generate(loaded, loaded_tokenizer.encode(prompt), max_new_tokens=12,
                                eos_token_id=loaded_tokenizer.eos_token_id)
        examples[prompt] = loaded_tokenizer.tokens(result.token_ids)
    report = {
        "seed": SEED, "threads": args.threads, "shape": SHAPE, "steps": args.steps, "batch_size": BATCH_SIZE,
        "peak_lr": PEAK_LR, "warmup_steps": WARMUP_STEPS, "weight_decay": WEIGHT_DECAY,
        "n_params": sum(p.numel() for p in loaded.parameters()),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "vocab_size": loaded_tokenizer.vocab_size, "n_sentences": len(sentences),
        "n_countries": len(rows), "accuracy": scores, "greedy_examples": examples,
        "train_wall_s": round(log["train_wall_s"], 1), "train_cpu_s": round(log["train_cpu_s"], 1),
        "load_average_during_training": round(os.getloadavg()[0], 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__, "final_loss": log["losses"][-1][1] if log["losses"] else None,
        "evals": log["evals"],
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_model_card(report, out / "README.md")
    print(json.dumps({k: report[k] for k in ("n_params", "weights_bytes", "train_wall_s", "train_cpu_s",
                                             "accuracy", "greedy_examples")}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
