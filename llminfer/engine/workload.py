"""Request streams for measuring an engine, and the serving metrics of a run. Chapter 05.

    workload = make_workload(n_requests=48, rate=40.0, vocab_size=cfg.vocab_size, seed=0)
    result = replay(engine, workload)             # real time: requests join when their arrival comes
    summary = summarize(result, slo_ttft_s=1.0, slo_tpot_s=0.05)

Arrivals are a Poisson process (exponential gaps) by default, as in the vLLM paper's experiments and
vLLM's benchmark; `burstiness` < 1 draws gamma-distributed gaps instead, burstier at the same mean
rate, as BurstGPT found real traffic to be. Prompt and output lengths are log-normal: most requests
short, a long tail of long ones, which is the shape request and response lengths take in published
chat traces (ShareGPT, BurstGPT). Everything comes from one seed.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .latency import SLO, percentile, request_goodput
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams

__all__ = ["Request", "Workload", "WorkloadResult", "make_workload", "replay", "summarize", "percentile",
           "few_shot_workload", "ChatWorkload", "multi_turn_workload", "run_chat", "PrefixCacheRun",
           "measure_prefix_cache"]


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt, how many tokens it wants, when it arrives (s after the start)."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and the settings that made them. Chapter 05."""
    requests: tuple[Request, ...]
    settings: dict = field(default_factory=dict)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(r.prompt_ids) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.max_new_tokens for r in self.requests]

    @property
    def arrivals_s(self) -> list[float]:
        return [r.arrival_s for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    values = np.exp(rng.normal(math.log(median), sigma, size=n))
    return [int(v) for v in np.clip(np.round(values), lo, hi)]


def make_workload(n_requests: int = 48, rate: float = 40.0, vocab_size: int = 1024, seed: int = 0,
                  prompt_median: float = 48, prompt_sigma: float = 0.8, max_prompt: int = 256,
                  output_median: float = 24, output_sigma: float = 0.8, max_output: int = 128,
                  burstiness: float = 1.0, shared_prefix: list[int] | None = None,
                  first_token_id: int = 3) -> Workload:
    """A reproducible request stream: Poisson (or gamma) arrivals, log-normal prompt and output lengths. Chapter 05.

    rate: mean requests per second (float('inf'): all arrive at once). Prompt tokens are drawn
    uniformly from first_token_id .. vocab_size - 1 (ids below it are usually special tokens);
    `shared_prefix` is put in front of every prompt (a system prompt, chapter 06).
    """
    if not isinstance(n_requests, int) or n_requests < 1:
        raise ValueError(f"n_requests must be a positive integer, got {n_requests!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second (inf: all at once), got {rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 is Poisson, below 1 burstier), got {burstiness!r}")
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first_token_id={first_token_id} must lie in 0..{vocab_size - 1}")
    for name, median, hi in (("prompt", prompt_median, max_prompt), ("output", output_median, max_output)):
        if not 1 <= median <= hi:
            raise ValueError(f"{name}_median={median} must lie in 1..max_{name}={hi}")
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = [0.0] * n_requests
    else:
        # gamma gaps with shape k and scale 1 / (k · rate) have mean 1 / rate; k = 1 is the exponential
        gaps = rng.gamma(burstiness, 1.0 / (burstiness * rate), size=n_requests)
        gaps[0] = 0.0                                                   # the first request opens the run
        arrivals = [float(t) for t in np.cumsum(gaps)]
    prompt_lens = _lognormal_lengths(rng, n_requests, prompt_median, prompt_sigma, 1, max_prompt)
    output_lens = _lognormal_lengths(rng, n_requests, output_median, output_sigma, 1, max_output)
    prefix = tuple(shared_prefix or ())
    requests = tuple(
        Request(prefix + tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=p)), o, a)
        for p, o, a in zip(prompt_lens, output_lens, arrivals))
    settings = dict(n_requests=n_requests, rate=rate, seed=seed, prompt_median=prompt_median,
                    prompt_sigma=prompt_sigma, max_prompt=max_prompt, output_median=output_median,
                    output_sigma=output_sigma, max_output=max_output, burstiness=burstiness,
                    shared_prefix_len=len(prefix))
    return Workload(requests, settings)


@dataclass
class WorkloadResult:
    """What a replay produced: outputs in workload order, the run's span, the engine's trace. Chapter 05."""
    outputs: list                       # RequestOutput per request, in workload order
    start_s: float                      # the engine clock when the run began (arrival times count from here)
    duration_s: float                   # start to the last token
    trace: list = field(default_factory=list)   # StepRecord per step
    arrivals_s: list[float] = field(default_factory=list)
    stats: object = None
    policy: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return len(self.outputs) / self.duration_s if self.duration_s > 0 else 0.0


def replay(engine, workload: Workload, params: SamplingParams | None = None, realtime: bool = True,
           progress: bool = False) -> WorkloadResult:
    """Runs the workload on the engine: each request joins at its arrival time; returns the outputs. Chapter 05.

    realtime=True waits (sleeps) when the engine is idle and the next request has not arrived yet;
    realtime=False lets every request arrive at once (offline throughput).
    `params` gives every other sampling setting (max_new_tokens comes from each request).
    """
    base = params or SamplingParams()
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s)
    ids: dict[int, int] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(pending), desc=f"{engine.policy}", leave=False)
    trace_start = len(engine.trace)
    start = engine.clock()
    cursor = 0
    while cursor < len(pending) or engine.has_unfinished():
        now = engine.clock()
        while cursor < len(pending):
            request = workload.requests[pending[cursor]]
            arrival = start + (request.arrival_s if realtime else 0.0)
            if arrival > now:
                break
            p = dataclasses.replace(base, max_new_tokens=request.max_new_tokens)   # every other setting kept
            ids[pending[cursor]] = engine.add_request(list(request.prompt_ids), p, arrival_time=arrival)
            cursor += 1
        if engine.has_unfinished():
            for event in engine.step():
                if event.finished and bar is not None:
                    bar.update(1)
        elif cursor < len(pending):
            time.sleep(max(0.0, start + workload.requests[pending[cursor]].arrival_s - engine.clock()))
    if bar is not None:
        bar.close()
    outputs = [engine.pop_output(ids[i]) for i in range(len(workload.requests))]
    last = max(start + o.e2e_s + (workload.requests[i].arrival_s if realtime else 0.0)
               for i, o in enumerate(outputs))
    trace = list(engine.trace)[trace_start:]
    return WorkloadResult(outputs, start, last - start, trace,
                          [r.arrival_s if realtime else 0.0 for r in workload.requests], engine.stats, engine.policy)


def summarize(result: WorkloadResult, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.1) -> dict:
    """Throughput, TTFT / TPOT / ITL / E2E medians and p90/p99, and goodput under the stated targets. Chapter 05.

    Goodput here is vLLM's (`--goodput`): requests per second that met both the TTFT and the TPOT target
    (`latency.request_goodput`). A one-token request has no TPOT and is judged by TTFT alone. A tail percentile
    without enough requests behind it is nan (`latency.percentile`).
    """
    outputs = result.outputs
    ttft = [o.ttft_s for o in outputs]
    tpot = [o.tpot_s for o in outputs if len(o.token_ids) > 1]
    itl = [gap for o in outputs for gap in o.itl_s]
    e2e = [o.e2e_s for o in outputs]
    slo = SLO(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s)
    good, goodput = request_goodput(((o.ttft_s, o.tpot_s, o.e2e_s, len(o.token_ids)) for o in outputs),
                                    result.duration_s, slo)
    summary = {"policy": result.policy, "requests": len(outputs), "output_tokens": result.output_tokens,
               "duration_s": result.duration_s, "throughput_tok_s": result.throughput,
               "request_throughput": result.request_throughput,
               "goodput_req_s": goodput if result.duration_s > 0 else 0.0,
               "slo_attained": good / len(outputs), "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s,
               "preemptions": sum(o.preemptions for o in outputs), "steps": len(result.trace)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = percentile(values, q)
    return summary


# --- workloads with shared prefixes: the prefix caches of chapters 06 and 13 compared -------------------------

CAPITALS = (("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"), ("Peru", "Lima"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Norway", "Oslo"), ("India", "New Delhi"),
            ("Canada", "Ottawa"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Cuba", "Havana"), ("Iran", "Tehran"),
            ("Ghana", "Accra"), ("Nepal", "Kathmandu"), ("Chad", "N'Djamena"), ("Fiji", "Suva"), ("Laos", "Vientiane"))
TOPICS = ("the weather", "a good book", "cooking pasta", "learning to swim", "the moon", "trains", "gardening",
          "chess", "the ocean", "music")


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int, first_token_id: int = 3) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=n))


def _chat_ids(tokenizer, messages: list[dict]) -> tuple[int, ...]:
    """messages through the tokenizer's chat template (its plain text, one message a line, without one)."""
    if tokenizer.chat_template is not None:
        return tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tuple(tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"))


def few_shot_workload(n_requests: int = 12, tokenizer=None, shots: int = 8, max_new_tokens: int = 8,
                      vocab_size: int = 1024, seed: int = 0) -> Workload:
    """Requests that share a long few-shot prefix and differ in their question, all arriving at once. Chapter 13.

    With a tokenizer: a system message with `shots` worked examples ("Q: What is the capital of Peru?
    A: Lima"), then each request's own question about another country, laid out by the tokenizer's chat
    template (SmolLM2's for `load_tokenizer("smollm2-135m-instruct")`). Without one: random ids, a prefix of
    16 per shot and questions of 6 to 16.
    """
    if not isinstance(shots, int) or not 1 <= shots < len(CAPITALS):
        raise ValueError(f"shots must lie in 1..{len(CAPITALS) - 1} (the examples come from {len(CAPITALS)} "
                         f"countries and the questions from the rest), got {shots!r}")
    if not isinstance(n_requests, int) or n_requests < 1:
        raise ValueError(f"n_requests must be a positive integer, got {n_requests!r}")
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        prefix = _random_ids(rng, 16 * shots, vocab_size)
        prompts = [prefix + _random_ids(rng, int(rng.integers(6, 17)), vocab_size) for _ in range(n_requests)]
    else:
        examples = "\n".join(f"Q: What is the capital of {country}?\nA: {city}" for country, city in CAPITALS[:shots])
        system = f"Answer with the name of the city only, as in these examples.\n{examples}"
        questions = [CAPITALS[shots + i % (len(CAPITALS) - shots)][0] for i in range(n_requests)]
        prompts = [_chat_ids(tokenizer, [{"role": "system", "content": system},
                                         {"role": "user", "content": f"Q: What is the capital of {q}?"}])
                   for q in questions]
    settings = dict(kind="few-shot", n_requests=n_requests, shots=shots, seed=seed, tokenizer=tokenizer is not None)
    return Workload(tuple(Request(p, max_new_tokens, 0.0) for p in prompts), settings)


@dataclass(frozen=True)
class ChatWorkload:
    """Conversations of several user turns; each turn's prompt is the conversation so far, the model's own
    answers included, and the new user message. Chapter 13.

    With a tokenizer, messages are text and a prompt is the whole conversation laid out again by its chat
    template, as a chat server does every turn; without one, messages are ids and a prompt is them and the
    answers' ids end to end.
    """
    conversations: tuple[tuple, ...]          # per conversation, its user messages in order
    max_new_tokens: int = 16
    tokenizer: object = None

    @property
    def n_turns(self) -> int:
        return max(len(c) for c in self.conversations)

    def __len__(self) -> int:
        return sum(len(c) for c in self.conversations)

    def prompt(self, users, answers) -> list[int]:
        """The prompt of the turn after `answers` (ids of the model's answers to users[:len(answers)])."""
        if self.tokenizer is None:
            ids: list[int] = []
            for i, user in enumerate(users[:len(answers) + 1]):
                ids += list(user) + (list(answers[i]) if i < len(answers) else [])
            return ids
        messages = []
        for i, user in enumerate(users[:len(answers) + 1]):
            messages.append({"role": "user", "content": user})
            if i < len(answers):
                messages.append({"role": "assistant", "content": self.tokenizer.decode(answers[i])})
        return list(_chat_ids(self.tokenizer, messages))


def multi_turn_workload(n_conversations: int = 4, n_turns: int = 4, tokenizer=None, max_new_tokens: int = 16,
                        vocab_size: int = 1024, seed: int = 0) -> ChatWorkload:
    """n_conversations chats of n_turns user messages each (small talk about a topic with a tokenizer, 8 to 24
    random ids without one). Chapter 13."""
    for name, value in (("n_conversations", n_conversations), ("n_turns", n_turns)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    rng = np.random.default_rng(seed)
    conversations = []
    for c in range(n_conversations):
        if tokenizer is None:
            conversations.append(tuple(_random_ids(rng, int(rng.integers(8, 25)), vocab_size) for _ in range(n_turns)))
        else:
            topic = TOPICS[c % len(TOPICS)]
            asks = (f"Tell me something about {topic}.", "Why is that?", "Can you give an example?",
                    "Say it in one sentence.", "What else should I know?")
            conversations.append(tuple(asks[t % len(asks)] for t in range(n_turns)))
    return ChatWorkload(tuple(conversations), max_new_tokens, tokenizer)


def run_chat(engine, chat: ChatWorkload, params: SamplingParams | None = None) -> list:
    """Runs the conversations turn by turn: every conversation's next turn is added at once, the engine runs
    them to the end, and their answers go into the next turn's prompts. Returns the RequestOutputs, turn by
    turn. Chapter 13."""
    base = params or SamplingParams()
    answers: list[list] = [[] for _ in chat.conversations]
    outputs = []
    for turn in range(chat.n_turns):
        live = [c for c, users in enumerate(chat.conversations) if turn < len(users)]
        prompts = [chat.prompt(chat.conversations[c], answers[c]) for c in live]
        turn_params = dataclasses.replace(base, max_new_tokens=chat.max_new_tokens)
        for c, out in zip(live, engine.generate(prompts, turn_params)):
            answers[c].append(out.token_ids)
            outputs.append(out)
    return outputs


@dataclass
class PrefixCacheRun:
    """One workload on one engine: what its prefix cache saved, and the engine (its tree, its pool). Chapter 13."""
    prefix_cache: str | None
    outputs: list                      # RequestOutput per request, in the order they ran
    stats: object                      # the engine's EngineStats at the end
    engine: object

    @property
    def prompt_tokens(self) -> int:
        return sum(o.num_prompt_tokens for o in self.outputs)

    @property
    def saved_tokens(self) -> int:
        """Prompt positions whose K/V came from the cache at admission, not from the model."""
        return sum(o.num_cached_tokens for o in self.outputs)

    @property
    def computed_tokens(self) -> int:
        """Prompt positions the model ran (recomputation after a preemption not counted)."""
        return self.prompt_tokens - self.saved_tokens

    @property
    def hit_rate(self) -> float:
        return self.saved_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        ttft = [o.ttft_s for o in self.outputs]
        return {"prefix_cache": self.prefix_cache or "none", "requests": len(self.outputs),
                "prompt_tokens": self.prompt_tokens, "saved_tokens": self.saved_tokens,
                "computed_tokens": self.computed_tokens, "hit_rate": self.hit_rate,
                "tokens_computed": self.stats.tokens_computed, "evictions": self.stats.evictions,
                "preemptions": self.stats.preemptions, "ttft_p50_s": percentile(ttft, 50),
                "ttft_mean_s": sum(ttft) / len(ttft)}


def measure_prefix_cache(model, workload: Workload | ChatWorkload, prefix_cache: str | None = "radix",
                         eos_token_id: int | None = None, **engine_settings) -> PrefixCacheRun:
    """Runs a workload on a fresh LLMEngine with prefix_cache "radix", "hash" or None (no cache); returns what
    it saved (`PrefixCacheRun.summary()`: hit rate, prefill tokens computed and saved, TTFT). Chapter 13.

    A `Workload` arrives all at once (`replay`, realtime=False); a `ChatWorkload` runs turn by turn (`run_chat`).
    Greedy decoding, so every cache setting makes the same tokens and sees the same prompts.
    """
    engine = LLMEngine(model, enable_prefix_caching=prefix_cache is not None, prefix_cache=prefix_cache or "hash",
                       **engine_settings)
    params = SamplingParams(eos_token_id=eos_token_id)
    if isinstance(workload, ChatWorkload):
        outputs = run_chat(engine, workload, params)
    else:
        outputs = replay(engine, workload, params, realtime=False).outputs
    return PrefixCacheRun(prefix_cache, outputs, engine.stats, engine)
