"""`python -m llminfer.bench structured`: how often a small chat model's JSON parses and validates, with and
without the constraint, and what the radix tree saves against the block hashes. Chapter 13.

    structured outputs   SCHEMAS (10 JSON Schemas, strings of at most 24 characters) x 5 subjects each = 50 chat
                         prompts, "... as JSON", answered
                         greedily by the engine in one batch twice: free, and masked by the schema's automaton
                         (`llminfer.structured.Constraint`). An answer counts when it parses and validates against
                         its schema (jsonschema); the report gives both rates and the free answers' failures.
    prefix caches        chapter 13's two workloads (few-shot, multi-turn chat) on the block hashes of chapter 06
                         and on the radix tree: prefill tokens saved, hit rate, TTFT p50, and whether the greedy
                         outputs are identical.

Writes data/benchmarks/structured-<cpu-class>.json and a table. The model is the real SmolLM2-135M-Instruct by
default (`--model`); its tokens, not its timings, decide the rates.
"""
from __future__ import annotations

import argparse
import json
import statistics

from ..checkpoint import load_pretrained
from ..engine import LLMEngine, SamplingParams
from ..engine.workload import few_shot_workload, measure_prefix_cache, multi_turn_workload
from ..structured import Constraint
from .report import device_slug, load_average, machine, publish

__all__ = ["SCHEMAS", "prompts", "run", "table", "SUMMARY", "add_arguments", "command"]

SUMMARY = "structured outputs: JSON parse and validity rates free and constrained; radix tree vs hashes (chapter 13)"


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


# Strings are bounded, as a schema for a model's output should be: an unbounded string lets a small model repeat
# itself inside the quotes (the automaton cannot force a quote while any character is allowed); maxLength makes it
# close the string. A maxLength counts characters, though, and an emoji is four byte tokens: the constraint's
# finish_within (set from max_tokens) closes what is still open when the tokens left only just cover it.
_STR, _INT, _NUM, _BOOL = ({"type": "string", "maxLength": 24}, {"type": "integer"}, {"type": "number"},
                           {"type": "boolean"})
# name -> (schema, what the prompt asks for with {} for the subject, five subjects)
SCHEMAS = {
    "capital": (_obj({"country": _STR, "capital": _STR}), "the capital of {} as JSON",
                ["France", "Japan", "Peru", "Kenya", "Spain"]),
    "person": (_obj({"name": _STR, "born": _INT, "field": _STR}), "a short profile of {} as JSON",
               ["Marie Curie", "Alan Turing", "Ada Lovelace", "Isaac Newton", "Charles Darwin"]),
    "book": (_obj({"title": _STR, "author": _STR, "year": _INT}), "the book '{}' as JSON",
             ["Dune", "Emma", "Ulysses", "Hamlet", "Beloved"]),
    "weather": (_obj({"city": _STR, "temperature_c": _NUM, "sunny": _BOOL}), "today's weather in {} as JSON",
                ["Paris", "Tokyo", "Lima", "Nairobi", "Madrid"]),
    "product": (_obj({"name": _STR, "price": _NUM, "in_stock": _BOOL}), "a product listing for {} as JSON",
                ["a laptop", "a bicycle", "a kettle", "a chair", "a lamp"]),
    "colour": (_obj({"name": _STR, "kind": {"enum": ["warm", "cool", "neutral"]}}), "the colour {} as JSON",
               ["red", "blue", "grey", "orange", "green"]),
    "list": (_obj({"topic": _STR, "items": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}}),
             "three examples of {} as JSON", ["fruits", "planets", "metals", "rivers", "birds"]),
    "address": (_obj({"street": _STR, "city": _STR, "zip": _STR, "country": _STR}, ["city", "country"]),
                "an example postal address in {} as JSON", ["Berlin", "Rome", "Oslo", "Quito", "Seoul"]),
    "event": (_obj({"name": _STR, "year": _INT, "place": _obj({"city": _STR, "country": _STR})}),
              "the historical event '{}' as JSON",
              ["the Moon landing", "the fall of the Berlin Wall", "the French Revolution", "the first Olympics",
               "the signing of the Magna Carta"]),
    "animal": (_obj({"species": _STR, "legs": _INT, "mammal": _BOOL, "diet": {"enum": ["herbivore", "carnivore",
                                                                                       "omnivore"]}}),
               "facts about the {} as JSON", ["cat", "spider", "eagle", "cow", "shark"]),
}


def prompts() -> list[tuple[str, str]]:
    """(schema name, the user's request) for every schema and subject: 50 in all."""
    return [(name, f"Give me {ask.format(subject)}.") for name, (_, ask, subjects) in SCHEMAS.items()
            for subject in subjects]


def _validates(text: str, schema: dict) -> tuple[bool, str]:
    """Whether text parses as JSON and validates against schema, and why not."""
    import jsonschema

    try:
        document = json.loads(text)
    except ValueError as error:
        return False, f"does not parse ({str(error)[:60]})"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as error:
        return False, f"parses, but {error.message[:60]}"
    return True, ""


def run(model_name: str = "smollm2-135m-instruct", max_tokens: int = 256, shots: int = 8) -> dict:
    """Returns the report: the rates free and constrained over `prompts()`, and the two caches on the two
    workloads. Chapter 13."""
    model, tokenizer = load_pretrained(model_name)
    report = {"machine": machine("cpu"), "slug": device_slug("cpu"), "load_average_before": load_average(),
              "model": model_name, "settings": {"max_tokens": max_tokens, "schemas": len(SCHEMAS),
                                                "prompts": len(prompts())}}
    engine = LLMEngine(model, num_blocks=1024, max_model_len=1024)
    params = SamplingParams(max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id)
    ids = {}
    for i, (name, ask) in enumerate(prompts()):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
        ids["free", i] = engine.add_request(chat, params)
        ids["constrained", i] = engine.add_request(chat, params, constraint=Constraint.from_schema(
            SCHEMAS[name][0], tokenizer))
    made = {request_id: [] for request_id in ids.values()}
    while engine.has_unfinished():
        for request_id, token, _ in engine.step():
            made[request_id].append(token)
    for mode in ("free", "constrained"):
        rows = []
        for i, (name, ask) in enumerate(prompts()):
            text = tokenizer.decode(made[ids[mode, i]], skip_special_tokens=True)
            ok, why = _validates(text, SCHEMAS[name][0])
            rows.append({"schema": name, "ask": ask, "valid": ok, "why": why, "text": text[:200]})
        report[mode] = {"valid": sum(r["valid"] for r in rows), "of": len(rows), "rows": rows}
    workloads = {"few-shot": few_shot_workload(12, tokenizer, shots=shots, max_new_tokens=8),
                 "multi-turn": multi_turn_workload(4, 4, tokenizer, max_new_tokens=16)}
    caches = {}
    for name, workload in workloads.items():
        # a warm-up run, then the two caches in turns, hash radix radix hash: drift hits both alike
        runs = {"hash": [], "radix": []}
        for cache in ("hash", "hash", "radix", "radix", "hash"):
            run = measure_prefix_cache(model, workload, cache, eos_token_id=tokenizer.eos_token_id, num_blocks=512,
                                       max_model_len=2048)
            runs[cache].append(run)
        runs["hash"].pop(0)
        found = {cache: pair[0] for cache, pair in runs.items()}
        caches[name] = {cache: {"prompt_tokens": r.prompt_tokens, "saved_tokens": r.saved_tokens,
                                "hit_rate": r.hit_rate,
                                "ttft_p50_s": statistics.mean(x.summary()["ttft_p50_s"] for x in runs[cache])}
                        for cache, r in found.items()}
        caches[name]["identical_outputs"] = ([o.token_ids for o in found["radix"].outputs]
                                             == [o.token_ids for o in found["hash"].outputs])
    report["prefix_caches"] = caches
    report["load_average_after"] = load_average()
    return report


def table(report: dict) -> str:
    """The report as a few lines of text."""
    free, constrained = report["free"], report["constrained"]
    lines = [f"{report['model']}, {report['settings']['prompts']} prompts over {report['settings']['schemas']} "
             f"schemas, greedy, at most {report['settings']['max_tokens']} tokens",
             f"  parse and validate: free {free['valid']}/{free['of']}, constrained "
             f"{constrained['valid']}/{constrained['of']}"]
    for name, caches in report["prefix_caches"].items():
        for cache in ("hash", "radix"):
            c = caches[cache]
            lines.append(f"  {name:<10} {cache:<5} saved {c['saved_tokens']:>5} of {c['prompt_tokens']:>5} prompt "
                         f"tokens, hit rate {c['hit_rate']:.0%}, TTFT p50 {1e3 * c['ttft_p50_s']:.0f} ms (mean of 2 runs in turns)")
        lines.append(f"  {name:<10} identical greedy outputs: {caches['identical_outputs']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the structured-output benchmark's options to parser, each default stated once. Chapter 13."""
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an installed chat model")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens at most per answer")
    parser.add_argument("--shots", type=int, default=8, help="examples in the few-shot workload's shared prefix")
    parser.add_argument("--out", default="data/benchmarks", help="folder for structured-<machine>.json")


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench structured`: runs both parts, prints the table, writes the report."""
    if args.max_tokens < 1 or args.shots < 1:
        parser.error(f"--max-tokens {args.max_tokens} and --shots {args.shots} must be positive integers")
    report = run(args.model, args.max_tokens, args.shots)
    publish(report, args.out, f"structured-{report['slug']}", table=table)
    return 0
