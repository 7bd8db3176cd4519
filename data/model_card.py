"""Write the bundled model's card (README.md) from the numbers data/build_model.py measured."""
from __future__ import annotations

from pathlib import Path

from build_corpus import HANDBOOK_SENTENCES, HELD_OUT_TEMPLATES, TRAIN_TEMPLATES, load_countries


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _accuracy_rows(report: dict) -> list[str]:
    acc = report["accuracy"]
    n = report["n_countries"]
    rows = [f"| `The capital of X is` | trained on | {_pct(acc['train_template'])} "
            f"({round(acc['train_template'] * n)}/{n}) |"]
    for name, (prompt, _) in HELD_OUT_TEMPLATES.items():
        shown = prompt.replace("{country}", "X").replace("{Country}", "X")
        rows.append(f"| `{shown}` | held out | {_pct(acc[name])} ({round(acc[name] * n)}/{n}) |")
    return rows


def _example_rows(report: dict) -> list[str]:
    rows = []
    for prompt, tokens in report["greedy_examples"].items():
        text = "".join(t for t in tokens if t not in ("<eos>", "<bos>", "<pad>"))
        rows.append(f"| `{prompt}` | `{text!r}` | {' '.join(f'`{t}`' for t in tokens)} |")
    return rows


def _example(report: dict, prompt: str) -> str:
    tokens = report["greedy_examples"].get(prompt)
    if tokens is None:
        return f"`{prompt}` (not measured)"
    text = "".join(t for t in tokens if t not in ("<eos>", "<bos>", "<pad>"))
    return f"`{prompt}` → `{text}`"


def write_model_card(report: dict, path: Path) -> None:
    """Write README.md for the model folder: data, training, size, measured accuracy, limits."""
    shape = report["shape"]
    rows = load_countries()
    notes = [f"- {r['country']}: {r['capital']}; {r['note']}" for r in rows if r["note"]]
    templates = "\n".join(f"- `{t}`" for t in TRAIN_TEMPLATES)
    held_out = "\n".join(f"- `{p}{c}`" for p, c in HELD_OUT_TEMPLATES.values())
    evals = "\n".join(
        f"| {e['step']} | {_pct(e['train_template'])} | " + " | ".join(_pct(e[k]) for k in HELD_OUT_TEMPLATES) + " |"
        for e in report["evals"])
    eval_header = "| step | `The capital of X is` | " + " | ".join(f"held out `{k}`" for k in HELD_OUT_TEMPLATES) + " |"
    eval_rule = "|---" * (2 + len(HELD_OUT_TEMPLATES)) + "|"
    mb = report["weights_bytes"] / 1e6
    text = f"""# tiny-capitals

A {report['n_params'] / 1e6:.2f}M-parameter Llama-family language model trained from scratch, in a few minutes
on one CPU thread, by `data/build_model.py`. It is the handbook's default model: small enough to ship in the
repository ({mb:.1f} MB of float32 weights) and to run anywhere, trained enough that the examples of the
prefill/decode chapters produce real text: greedy decoding of `The capital of France` gives ` is Paris.` and
then the end-of-sequence token.

**It knows only its own corpus.** It was trained on {report['n_sentences']:,} short
sentences (some repeated): the capitals of
{report['n_countries']} countries in a few phrasings, the handbook's example sentences and simple filler
sentences. It is not a general language model, it cannot chat, and outside that corpus it produces confident
nonsense (see *Limits*). Use it to watch inference happen, not for its answers.

## Use

```python
import llminfer
model, tokenizer = llminfer.load_pretrained("tiny-capitals")      # from data/models, no network
ids = tokenizer.encode("The capital of France")                    # no BOS token is added
result = llminfer.generate(model, ids, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)
tokenizer.decode(result.token_ids)                                 # ' is Paris.'
```

The folder is a standard Hugging Face checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`), so `transformers.AutoModelForCausalLM.from_pretrained`
loads it too; `tests/test_bundled_model.py` checks that its logits match llminfer's within 1e-4.

## Architecture

| | |
|---|---|
| type | Llama (`LlamaForCausalLM`): RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention |
| layers | {shape['n_layers']} |
| width (`hidden_size`) | {shape['dim']} |
| query heads / key-value heads | {shape['n_heads']} / {shape['n_kv_heads']} (head_dim {shape['dim'] // shape['n_heads']}) |
| MLP width (`intermediate_size`) | {shape['hidden_dim']} |
| vocabulary | {report['vocab_size']} byte-level BPE tokens; `<pad>`=0, `<bos>`=1, `<eos>`=2 |
| max positions | {shape['max_seq_len']} |
| embeddings | untied (separate `lm_head`) |
| parameters | {report['n_params']:,} |
| weights file | `model.safetensors`, float32, {report['weights_bytes']:,} bytes |

## Training data

Written by `data/build_corpus.py` to `data/corpus/train.txt`, from `data/countries.csv`: the
{report['n_countries']} countries of the world (the 193 UN member states and the 2 observer states) with
one capital each and a continent. Each country fills these templates:

{templates}

plus the handbook's own sentences ({len(HANDBOOK_SENTENCES)} of them, e.g. `I love AI.`, each repeated),
simple facts (`The sky is blue.`), and varied sentences drawn from a small grammar with a fixed seed
(`The farmer bakes bread in the kitchen.`, `Three plus four is seven.`). Each training sequence is one sentence
followed by `<eos>` and starts **without** a `<bos>` token, because the handbook's prompts are encoded
without one.

Held out of training (and of the tokenizer's corpus), to test whether the facts carry over to phrasings the
model never saw:

{held_out}

Where a country's capital is a matter of definition or dispute, the table picks one and says so:

{chr(10).join(notes)}

## Tokenizer

Byte-level BPE trained with the `tokenizers` library on the training corpus (`data/build_tokenizer.py`),
{report['vocab_size']} tokens, no prefix space added, ByteLevel decoder (text round-trips exactly). It splits
the article's prompts as the article does: `The capital of France is` into the 5 tokens
`[The][ capital][ of][ France][ is]`, and `I love AI` into the 3 tokens `[I][ love][ AI]`.

## Training

| | |
|---|---|
| code | `data/build_model.py` (`make model`), llminfer's own `Transformer` |
| objective | next-token cross-entropy, padding not scored |
| steps x batch | {report['steps']} x {report['batch_size']} sentences (batches grouped by length) |
| optimiser | AdamW, betas (0.9, 0.95), weight decay {report['weight_decay']} on matrices, gradient clipping 1.0 |
| learning rate | linear warmup over {report['warmup_steps']} steps to {report['peak_lr']}, cosine decay to 5% of it |
| initialisation | N(0, 0.02²), seed {report['seed']} |
| seed | {report['seed']} for corpus, tokenizer, weights and batch order; deterministic torch kernels |
| threads | {report['threads']} CPU thread (`torch.set_num_threads`) |
| training time | {report['train_wall_s']:.0f} s wall clock, {report['train_cpu_s']:.0f} s of CPU time |
| final training loss | {report['final_loss']} (smoothed; the filler sentences are random, so it cannot reach 0) |
| torch | {report['torch']} |

The training time was measured on a 2-core virtual machine shared with other jobs (load average about
{report['load_average_during_training']} at the end of training), so the wall clock time depends on what else
runs; the CPU time is the better measure of the work. One thread is deliberate: on that shared machine two
threads measured 5 to 25 times slower per step than one, and a single thread fixes the order of every sum.
A rebuild with `make model` gives the same greedy outputs (two rebuilds on that machine gave bitwise-identical
weights; on other machines and torch builds they may differ in the last bits).

Accuracy during training (greedy exact match over all {report['n_countries']} countries):

{eval_header}
{eval_rule}
{evals}

## Measured accuracy

Greedy decoding, exact match: the prompt must be continued by exactly ` <capital>.` and then `<eos>`.
Measured on the saved checkpoint over all {report['n_countries']} countries.

| prompt | template | accuracy |
|---|---|---|
{chr(10).join(_accuracy_rows(report))}

Greedy outputs (tokens as text):

| prompt | continuation | tokens |
|---|---|---|
{chr(10).join(_example_rows(report))}

## Limits

- It knows one short fact per country and the sentences above; nothing else. A made-up country still gets
  an answer: {_example(report, "The capital of Atlantis is")}.
- Phrasings far from the training templates fail: `The capital of X is called` scores
  {_pct(report['accuracy']['called'])}; the model has never seen `is called` and goes on with pieces of a name
  ({_example(report, "The capital of France is called")}).
- Its capitals are one choice per country as of the table's writing; capitals move and some are disputed (see above).
- It is far too small to show anything about the speed of real models: the handbook times random-weight models
  of published shapes (`llminfer.load_random`) for that.
- Its vocabulary is {report['vocab_size']:,} tokens learned from this corpus; other text is cut into many short pieces.

## Rebuild

`make model` (runs `python data/build_model.py`) rewrites the corpus, the tokenizer, the weights, this card and
`training_report.json` (the raw numbers this card is made from).
"""
    path.write_text(text, encoding="utf-8")


def write_draft_model_card(report: dict, path: Path) -> None:
    """Write README.md for the draft model folder: what it is for, training, size, agreement with the target, limits."""
    shape = report["shape"]
    agreement = report["greedy_agreement_with_target"]
    step = report["decode_step_ms"]
    n = report["n_countries"]
    mb = report["weights_bytes"] / 1e6
    acc = report["accuracy"]
    evals = "\n".join(
        f"| {e['step']} | {_pct(e['train_template'])} | " + " | ".join(_pct(e[k]) for k in HELD_OUT_TEMPLATES) + " |"
        for e in report["evals"])
    eval_header = "| step | `The capital of X is` | " + " | ".join(f"held out `{k}`" for k in HELD_OUT_TEMPLATES) + " |"
    eval_rule = "|---" * (2 + len(HELD_OUT_TEMPLATES)) + "|"
    agreement_rows = "\n".join(
        f"| {label} | {a['prompts']} | {a['positions']} | {_pct(a['agreement'])} |"
        for label, a in (("`The capital of X is`, every country", agreement["capital_prompts"]),
                         ("the held-out phrasings, every country", agreement["held_out_prompts"]),
                         ("the example prompts below", agreement["example_prompts"])))
    text = f"""# tiny-capitals-draft

The **draft model** of the handbook's chapter 09 (speculative decoding): a {report['n_params'] / 1e6:.2f}M-parameter,
{shape['n_layers']}-layer Llama-family model trained by `data/build_model.py --draft` on exactly the corpus of its
target, [`{report['target']}`](../{report['target']}/README.md) ({report['target_n_layers']} layers,
{report['target_n_params'] / 1e6:.2f}M parameters), with the target's tokenizer copied byte for byte. It exists to
guess the target's next tokens cheaply: speculative decoding lets it propose a few tokens, and the target checks
them all in one forward pass. Its own answers are worse than the target's; what matters is how often they agree.

## Use

```python
import llminfer
from llminfer import speculative
target, tokenizer = llminfer.load_pretrained("tiny-capitals")
draft, _ = llminfer.load_pretrained("tiny-capitals-draft")
ids = tokenizer.encode("The capital of France is")
result = speculative.generate(target, ids, speculative.DraftModelDrafter(draft), num_speculative_tokens=4,
                              max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)
tokenizer.decode(result.token_ids), result.acceptance_rate
```

It is also an ordinary Hugging Face checkpoint (`LlamaForCausalLM`), loadable on its own.

## Architecture

| | draft | target |
|---|---|---|
| layers | {shape['n_layers']} | {report['target_n_layers']} |
| width / query heads / K-V heads | {shape['dim']} / {shape['n_heads']} / {shape['n_kv_heads']} | the same |
| MLP width | {shape['hidden_dim']} | the same |
| vocabulary | {report['vocab_size']} (the same `tokenizer.json`) | {report['vocab_size']} |
| max positions | {shape['max_seq_len']} | the same |
| parameters | {report['n_params']:,} | {report['target_n_params']:,} |
| weights file | float32, {report['weights_bytes']:,} bytes ({mb:.1f} MB) | |

One layer rather than a thinner four: on a CPU a model this small spends its time on the fixed cost of each
operator call, not on arithmetic, so a step's cost follows the number of layers far more than their width.

## How well it guesses the target

Greedy agreement: along the target's own greedy continuation of each prompt (up to 16 tokens, to `<eos>`), the
fraction of positions where the draft's most likely next token is the target's. This is the acceptance rate of
greedy speculative decoding per drafted token (chapter 09 calls it α).

| prompts | count | positions | agreement |
|---|---|---|---|
{agreement_rows}

One single-token decode step, median CPU time over 200 steps of each model taken in turn on one CPU thread,
measured right after training on the machine below: draft {step['draft']:.3f} ms, target {step['target']:.3f} ms,
a cost ratio c = {step['ratio']:.2f}.
Chapter 09 measures both again on the reader's machine and puts them into the expected-speedup formula.

## Training

The target's recipe, unchanged apart from the depth: {report['steps']} steps x {report['batch_size']} sentences of
`data/corpus/train.txt` ({report['n_sentences']:,} sentences), AdamW (0.9, 0.95), weight decay
{report['weight_decay']} on matrices, warmup over {report['warmup_steps']} steps to {report['peak_lr']} then cosine
decay to 5%, seed {report['seed']}, deterministic kernels, {report['threads']} CPU thread, torch {report['torch']}.
Training took {report['train_cpu_s']:.0f} s of CPU time ({report['train_wall_s']:.0f} s of wall clock) on a 2-core
virtual machine shared with other jobs (load average {report['load_average_during_training']} at the end, so the wall
clock counts the time those jobs held the cores); final smoothed loss {report['final_loss']}.

{eval_header}
{eval_rule}
{evals}

## Measured accuracy

Greedy exact match on the saved checkpoint over all {n} countries (` <capital>.` then `<eos>`):
`The capital of X is` {_pct(acc['train_template'])}; held out: """ + ", ".join(
        f"`{k}` {_pct(acc[k])}" for k in HELD_OUT_TEMPLATES) + f""".

| prompt | continuation | tokens |
|---|---|---|
{chr(10).join(_example_rows(report))}

## Limits

- Everything the target's card says about its knowledge applies here, more so: with one layer it misses
  more capitals and phrasings than the target.
- Its mistakes cost speed, never correctness: speculative decoding keeps the target's output exactly (greedy:
  token for token; sampling: in distribution), whatever the draft proposes.
- It only makes sense beside `{report['target']}`: another target would need its own draft, with the same tokenizer.

## Rebuild

`make model` rebuilds the target and then this model; `python data/build_model.py --draft` rebuilds this one alone
from the target's folder (corpus and tokenizer are reused, so the target is not touched).
"""
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    import json
    import sys

    draft = "--draft" in sys.argv[1:]       # the draft model of chapter 09 instead
    folder = Path(__file__).resolve().parent / "models" / ("tiny-capitals-draft" if draft else "tiny-capitals")
    write = write_draft_model_card if draft else write_model_card
    write(json.loads((folder / "training_report.json").read_text()), folder / "README.md")
    print(f"wrote {folder / 'README.md'} from training_report.json")
