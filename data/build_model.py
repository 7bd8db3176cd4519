"""Rebuild the bundled model data/models/tiny-capitals from scratch: corpus, tokenizer, weights, model card.

`make model` runs this, then `--draft`, which trains the one-layer draft model data/models/tiny-capitals-draft
(chapter 09) on the same corpus with the same tokenizer. Everything is seeded, so a rebuild gives the same greedy
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
# The draft model of chapter 09 (speculative decoding): the same corpus, tokenizer and recipe, one layer instead of
# four, so that one of its decode steps costs a fraction of the target's while it still guesses most tokens.
DRAFT_DIR = DATA_DIR / "models" / "tiny-capitals-draft"
DRAFT_SHAPE = dict(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=384, max_seq_len=128)
DRAFT_STEPS = 2000
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


def train(sentences: list[str], tokenizer, rows, held_out, steps: int = STEPS,
          shape: dict | None = None) -> tuple[llminfer.Transformer, dict]:
    """Train the model (SHAPE unless `shape` is given) on sentence + <eos> sequences (no BOS); return it with a log."""
    config = llminfer.ModelConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **(SHAPE if shape is None else shape))
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
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {STEPS}; "
                        f"{DRAFT_STEPS} with --draft)")
    parser.add_argument("--out", type=Path, default=None, help=f"model folder (default {MODEL_DIR}; "
                        f"{DRAFT_DIR} with --draft)")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"CPU threads (default {THREADS})")
    parser.add_argument("--draft", action="store_true", help="build the draft model tiny-capitals-draft instead "
                        "(chapter 09); it reuses the tokenizer of the model in --target")
    parser.add_argument("--target", type=Path, default=MODEL_DIR, help=f"with --draft: the target model's folder "
                        f"(default {MODEL_DIR})")
    args = parser.parse_args()
    if args.draft:
        build_draft(args.out or DRAFT_DIR, args.target, args.steps or DRAFT_STEPS, args.threads)
        return
    args.steps = args.steps or STEPS
    out = args.out or MODEL_DIR
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


@torch.no_grad()
def greedy_agreement(draft, target, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> dict:
    """How often the draft's greedy next token equals the target's along the target's own greedy outputs.

    This is the acceptance rate of greedy speculative decoding per drafted position: teacher-forced on
    prompt + the target's continuation, one forward of each model, the argmaxes compared position by position.
    """
    agree = total = 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        continuation = llminfer.generate(target, ids, max_new_tokens=max_new_tokens,
                                         eos_token_id=tokenizer.eos_token_id).token_ids
        full = torch.tensor([ids + continuation])                        # (1, T)
        lo, hi = len(ids) - 1, full.shape[1] - 1                         # rows that predict the continuation
        draft_next = draft(full).argmax(-1)[0, lo:hi]
        target_next = target(full).argmax(-1)[0, lo:hi]
        agree += int((draft_next == target_next).sum())
        total += hi - lo
    return {"agreement": agree / total, "positions": total, "prompts": len(prompts)}


def decode_step_seconds(models: list, prompt_ids: list[int], repeats: int = 200) -> list[float]:
    """Median CPU seconds of one single-token decode step after the prompt, for each model (one thread).

    The models' steps are interleaved, and each is timed by this process's CPU time, which other jobs on a
    shared machine cannot inflate (a wall clock would also count the time they hold the cores).
    """
    import statistics

    def stepper(model):
        cache = model.new_cache(1)
        llminfer.prefill(model, torch.tensor([prompt_ids]), cache)
        length, token = cache.length, torch.tensor([[prompt_ids[-1]]])

        def step():
            cache.truncate(length)
            with torch.inference_mode():
                model(token, cache=cache)
        return step

    steps = [stepper(model) for model in models]
    times: list[list[float]] = [[] for _ in models]
    for round_ in range(20 + repeats):                 # the first 20 rounds warm up
        for step, record in zip(steps, times):
            start = time.process_time()
            step()
            if round_ >= 20:
                record.append(time.process_time() - start)
    return [statistics.median(record) for record in times]


def build_draft(out: Path, target_dir: Path, steps: int, threads: int) -> None:
    """Train tiny-capitals-draft on the target's corpus with the target's tokenizer; write weights, report and card."""
    import shutil

    from model_card import write_draft_model_card

    seed_everything()
    torch.set_num_threads(threads)
    if not (target_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {target_dir}; build the target model first "
                                "(python data/build_model.py), then the draft with --draft")
    try:
        sentences, held_out = read_corpus()
    except FileNotFoundError:
        write_corpus(SEED)
        sentences, held_out = read_corpus()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):       # the very same tokenizer, byte for byte
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    tokenizer = llminfer.Tokenizer.from_file(out / "tokenizer.json")
    rows = load_countries()
    model, log = train(sentences, tokenizer, rows, held_out, steps, shape=DRAFT_SHAPE)
    llminfer.save_pretrained(model, out)
    draft, draft_tokenizer = llminfer.load_pretrained(out, device="cpu")
    target, _ = llminfer.load_pretrained(target_dir, device="cpu")
    scores = evaluate(draft, draft_tokenizer, rows, held_out)
    examples = {}
    for prompt in EXAMPLE_PROMPTS:
        result = llminfer.generate(draft, draft_tokenizer.encode(prompt), max_new_tokens=12,
                                   eos_token_id=draft_tokenizer.eos_token_id)
        examples[prompt] = draft_tokenizer.tokens(result.token_ids)
    capital_prompts = [f"The capital of {r['name_in_sentence']} is" for r in rows]
    held_out_prompts = [p for _, p, _ in held_out]
    agreement = {"capital_prompts": greedy_agreement(draft, target, tokenizer, capital_prompts),
                 "held_out_prompts": greedy_agreement(draft, target, tokenizer, held_out_prompts),
                 "example_prompts": greedy_agreement(draft, target, tokenizer, EXAMPLE_PROMPTS)}
    timing_prompt = tokenizer.encode("The capital of France is")
    draft_s, target_s = decode_step_seconds([draft, target], timing_prompt)
    report = {
        "seed": SEED, "threads": threads, "shape": DRAFT_SHAPE, "steps": steps, "batch_size": BATCH_SIZE,
        "peak_lr": PEAK_LR, "warmup_steps": WARMUP_STEPS, "weight_decay": WEIGHT_DECAY,
        "target": target_dir.name, "target_n_layers": target.config.n_layers,
        "n_params": sum(p.numel() for p in draft.parameters()),
        "target_n_params": sum(p.numel() for p in target.parameters()),
        "weights_bytes": (out / "model.safetensors").stat().st_size,
        "vocab_size": draft_tokenizer.vocab_size, "n_sentences": len(sentences),
        "n_countries": len(rows), "accuracy": scores, "greedy_examples": examples,
        "greedy_agreement_with_target": agreement,
        "decode_step_ms": {"draft": round(draft_s * 1e3, 3), "target": round(target_s * 1e3, 3),
                           "ratio": round(draft_s / target_s, 3)},
        "train_wall_s": round(log["train_wall_s"], 1), "train_cpu_s": round(log["train_cpu_s"], 1),
        "load_average_during_training": round(os.getloadavg()[0], 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__, "final_loss": log["losses"][-1][1] if log["losses"] else None,
        "evals": log["evals"],
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_draft_model_card(report, out / "README.md")
    print(json.dumps({k: report[k] for k in ("n_params", "weights_bytes", "train_wall_s", "train_cpu_s", "accuracy",
                                             "greedy_agreement_with_target", "decode_step_ms")},
                     indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
