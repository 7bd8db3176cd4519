"""Chapter 05's exercises: one request's prefill in chunks, static against continuous batching, a scheduler step."""
from __future__ import annotations

import random

from . import as_wholes, exercise, not_a, run_code

CHUNK_BUDGET, CHUNK_DECODERS, CHUNK_PROMPT = 64, 5, 180      # 05.1
STEPS_PROMPT, STEPS_OUTPUTS, STEPS_SEQS = 8, (2, 9, 3, 5), 2   # 05.2: four requests, at most two at a time
STEP_BUDGET, STEP_SEQS = 48, 4                                 # 05.3


def _run(prompt_lens, output_lens, budget, max_num_seqs, policy="continuous", on_step=None) -> list[dict]:
    """Runs requests (all waiting at the start) through the engine's Scheduler with a model that always samples
    token 0; returns each step's {request id: tokens}. on_step(scheduler) is called before each step."""
    from ..engine import BlockManager, SamplingParams, Sequence
    from ..engine.scheduler import Scheduler
    blocks = sum(-(-(p + o) // 16) for p, o in zip(prompt_lens, output_lens))
    scheduler = Scheduler(BlockManager(blocks, 16, enable_prefix_caching=False), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, policy=policy)
    for i, (prompt, output) in enumerate(zip(prompt_lens, output_lens)):
        scheduler.add(Sequence(i, [1] * prompt, SamplingParams(max_new_tokens=output), 0.0))
    steps = []
    while scheduler.has_unfinished():
        if on_step is not None:
            on_step(scheduler)
        metadata = scheduler.schedule()
        scheduler.finish_step(metadata)
        steps.append(dict(zip((s.request_id for s in metadata.seqs), metadata.query_lens)))
        for seq, sample in zip(metadata.seqs, metadata.sample):
            if sample and seq.append_token(0, 0.0):
                scheduler.remove(seq)
    return steps


@exercise("05.1", "a 180-token prompt beside 5 decoding sequences under a budget of 64 tokens")
def prefill_chunks(answer):
    numbers = as_wholes(answer, 2)
    if numbers is None:
        return not_a("two whole numbers (tokens in the first chunk, steps until the prompt is done)", answer)
    chunk, steps = numbers
    # five requests already decoding (one-token prompts, long outputs), then the new one
    run = _run([1] * CHUNK_DECODERS + [CHUNK_PROMPT], [100] * CHUNK_DECODERS + [1], CHUNK_BUDGET, 16)
    new = CHUNK_DECODERS
    chunks = [step[new] for step in run if new in step]
    if chunk == CHUNK_BUDGET:
        return False, (f"the {CHUNK_DECODERS} decoding sequences come first, one token each: the prompt gets what "
                       f"is left of the {CHUNK_BUDGET} (section 4)")
    if chunk != chunks[0]:
        return False, f"{chunk} tokens: the budget less one token per running decode"
    if steps == -(-CHUNK_PROMPT // CHUNK_BUDGET):
        return False, "every step keeps its one token per decoding sequence: each chunk is the smaller one"
    if steps != len(chunks):
        return False, f"{steps} steps: chunks of {chunks[0]} until the {CHUNK_PROMPT} prompt tokens are all computed"
    return True, f"chunks {' + '.join(map(str, chunks))} = {CHUNK_PROMPT}: {len(chunks)} steps, as the Scheduler runs it"


@exercise("05.2", "steps for four requests, at most two at a time: static against continuous batching")
def static_against_continuous(answer):
    numbers = as_wholes(answer, 2)
    if numbers is None:
        return not_a("two whole numbers (static steps, continuous steps)", answer)
    static, continuous = numbers
    n = len(STEPS_OUTPUTS)
    want = tuple(len(_run([STEPS_PROMPT] * n, STEPS_OUTPUTS, 64, STEPS_SEQS, policy))
                 for policy in ("static", "continuous"))
    if (static, continuous) == want[::-1]:
        return False, "the two are swapped: continuous batching never takes more steps here"
    if static == sum(STEPS_OUTPUTS):
        return False, "that is one request at a time; a static batch runs two together, for as long as its longest"
    if static != want[0]:
        return False, (f"static: the first batch runs as long as its longest output, {max(STEPS_OUTPUTS[:2])} steps "
                       "(the prompt step makes the first token), then the second batch likewise (section 3)")
    if continuous != want[1]:
        return False, ("continuous: a finished request's place is taken in the very next step; follow the two slots "
                       "step by step (the admitted prompt runs beside the other's decode)")
    return True, f"static {want[0]} steps, continuous {want[1]}: a short request's slot no longer waits for a long one"


def _state(scheduler):
    running = [(s.request_id, s.num_remaining, s.is_decoding) for s in scheduler.running]
    waiting = [(s.request_id, s.num_prompt_tokens) for s in scheduler.waiting]
    return running, waiting


@exercise("05.3", "one continuous-batching step: decode, chunk, admit, against the engine's Scheduler")
def scheduler_step(answer):
    if not callable(answer):
        return not_a("a function step(running, waiting, budget, max_num_seqs) -> {request_id: tokens}", answer)
    generator = random.Random(0)
    prompts = [generator.randint(1, 120) for _ in range(12)]
    outputs = [generator.randint(1, 12) for _ in range(12)]
    states = []
    steps = _run(prompts, outputs, STEP_BUDGET, STEP_SEQS, on_step=lambda scheduler: states.append(_state(scheduler)))
    for number, ((running, waiting), want) in enumerate(zip(states, steps), 1):
        mine, error = run_code(answer, list(running), list(waiting), STEP_BUDGET, STEP_SEQS)
        if error:
            return False, error
        if not isinstance(mine, dict):
            return not_a("a dict {request_id: tokens}", mine)
        if {k: int(v) for k, v in mine.items() if v} != want:
            return False, (f"step {number}: running {running}, waiting {waiting}: you scheduled {mine}, the "
                           f"Scheduler {want}. Decodes come first, one token each; then the partly prefilled, in "
                           f"admission order; then waiting requests, first come first served, while tokens are left "
                           f"and fewer than {STEP_SEQS} run (section 4)")
    return True, f"{len(steps)} steps of a 12-request workload scheduled exactly as llminfer.engine's Scheduler does"
