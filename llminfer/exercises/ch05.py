"""Chapter 05's exercises: one request's prefill in chunks, static against continuous batching, a prefill-first step."""
from __future__ import annotations

import random

from . import as_wholes, exercise, not_a, run_code

CHUNK_BUDGET, CHUNK_DECODERS, CHUNK_PROMPT = 64, 5, 180      # 05.1
STEPS_PROMPT, STEPS_OUTPUTS, STEPS_SEQS = 8, (2, 9, 3, 5), 2   # 05.2: four requests, at most two at a time
STEP_BUDGET, STEP_SEQS, STEP_BLOCK = 48, 4, 16                 # 05.3: section 2's pool has blocks of 16


def _run(prompt_lens, output_lens, budget, max_num_seqs, policy="continuous") -> list[dict]:
    """Runs requests (all waiting at the start) through the engine's Scheduler with a model that always samples
    token 0; returns each step's {request id: tokens}."""
    from ..engine import BlockManager, SamplingParams, Sequence
    from ..engine.scheduler import Scheduler
    blocks = sum(-(-(p + o) // 16) for p, o in zip(prompt_lens, output_lens))
    scheduler = Scheduler(BlockManager(blocks, 16, enable_prefix_caching=False), max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, policy=policy)
    for i, (prompt, output) in enumerate(zip(prompt_lens, output_lens)):
        scheduler.add(Sequence(i, [1] * prompt, SamplingParams(max_new_tokens=output), 0.0))
    steps = []
    while scheduler.has_unfinished():
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
                       f"is left of the {CHUNK_BUDGET} (sections 2 and 5)")
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
                       "(the prompt step makes the first token), then the second batch likewise (section 4)")
    if continuous != want[1]:
        return False, ("continuous: a finished request's place is taken in the very next step; follow the two slots "
                       "step by step (the admitted prompt runs beside the other's decode)")
    return True, f"static {want[0]} steps, continuous {want[1]}: a short request's slot no longer waits for a long one"


class _Request:
    """A request as chapter 05's section 2 holds it (the same attributes), for the reader's step to schedule."""

    def __init__(self, request_id, prompt_len, max_new_tokens):
        self.id, self.prompt_len, self.max_new = request_id, prompt_len, max_new_tokens
        self.made = self.computed = self.blocks = 0

    @property
    def remaining(self):
        return self.prompt_len + self.made - self.computed

    @property
    def decoding(self):
        return self.made > 0 and self.remaining == 1

    def __repr__(self):
        state = "decoding" if self.decoding else f"{self.remaining} prompt tokens to go"
        return f"#{self.id} ({state})"


def _ordered_step(order: tuple[str, ...]):
    """A reference step that serves its parts in `order`: "prefills" (chunks of started prompts), "admit" (waiting
    requests, first come first served) and "decodes" (one token each). The pool has room for every request."""
    def step(running, waiting, pool, budget, max_seqs):
        scheduled = {}

        def run(request):
            nonlocal budget
            n = min(request.remaining, budget)
            need = -(-(request.computed + n) // STEP_BLOCK) - request.blocks
            pool["free"], request.blocks = pool["free"] - need, request.blocks + need
            scheduled[request.id], budget = n, budget - n

        for part in order:
            if part == "admit":
                while waiting and budget > 0 and len(running) < max_seqs:
                    running.append(waiting.pop(0))
                    run(running[-1])
            else:
                for request in [r for r in running if r.decoding == (part == "decodes") and r.id not in scheduled]:
                    if budget > 0:
                        run(request)
        return scheduled, []
    return step


_PREFILL_FIRST = ("prefills", "admit", "decodes")
_MISTAKES = {("decodes", "prefills", "admit"): "that is section 2's order: the decodes still come first",
             ("prefills", "decodes", "admit"): ("the started prompts come first, but new requests are admitted after "
                                                "the decodes; their prompts are prompt work too: admit them first")}


def _serve(step, prompts, outputs, states=None):
    """Section 2's serve loop over _Request objects with a pool that holds every request; each step's schedule.
    states, if given, gets the running and waiting requests (as text) before each step."""
    waiting = [_Request(i, p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    running, pool, steps = [], {"free": sum(-(-(p + o) // STEP_BLOCK) for p, o in zip(prompts, outputs))}, []
    while (waiting or running) and len(steps) < 10 * sum(prompts) + sum(outputs):
        if states is not None:
            states.append((repr(running), repr(waiting)))
        result = step(running, waiting, pool, STEP_BUDGET, STEP_SEQS)
        scheduled = result[0] if isinstance(result, tuple) and len(result) == 2 else result
        if not isinstance(scheduled, dict):
            raise TypeError(f"a step returns (scheduled, preempted) with scheduled a dict, got {result!r}")
        scheduled = {k: int(v) for k, v in scheduled.items() if v}
        for request in list(running):
            if request.id in scheduled:
                request.computed += scheduled[request.id]
                if request.computed == request.prompt_len + request.made:
                    request.made += 1
                    if request.made == request.max_new:
                        running.remove(request)
                        pool["free"] += request.blocks
        steps.append(scheduled)
    return steps


@exercise("05.3", "a prefill-first step: section 2's step with prompt work before the decodes")
def prefill_first_step(answer):
    if not callable(answer):
        return not_a("a function step(running, waiting, pool, budget, max_seqs) -> (scheduled, preempted)", answer)
    generator = random.Random(0)
    prompts = [generator.randint(1, 120) for _ in range(12)]
    outputs = [generator.randint(1, 12) for _ in range(12)]
    states = []
    want = _serve(_ordered_step(_PREFILL_FIRST), prompts, outputs, states)
    mine, error = run_code(_serve, answer, prompts, outputs)
    if error:
        return False, error
    if mine == want:
        return True, (f"{len(want)} steps of a 12-request workload scheduled prefill-first, as the reference does: "
                      "new requests reach their first token sooner, and the decodes wait behind the prompts")
    for order, why in _MISTAKES.items():
        if mine == _serve(_ordered_step(order), prompts, outputs):
            return False, why
    number = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b), min(len(mine), len(want)))
    running, waiting = states[min(number, len(states) - 1)]
    return False, (f"step {number + 1}: running {running}, waiting {waiting}: you scheduled "
                   f"{mine[number] if number < len(mine) else 'nothing'}, prefill-first schedules "
                   f"{want[number] if number < len(want) else 'nothing'}. First chunks of the started prompts in "
                   f"admission order, then admissions (first come first served, while fewer than {STEP_SEQS} run), "
                   "then one token per decoding request, each while the budget lasts")
