"""The checks of user values, in one place: every value refused before any compute, with a message that names the
value, the limit and the fix. Chapter 01.

    is_int(value)                            an integer, and not a bool
    check_flag(name, value)                  True or False, nothing else
    check_int(name, value, minimum, maximum) an integer within bounds
    check_float32(name, value, fix)          a finite number that float32 holds as a normal number (or 0)
    check_sampling(...)                      the sampling and stopping settings of a request
    check_processors(...)                    min-p and the repetition, presence and frequency penalties
    check_token_ids(ids, vocab_size)         every id inside the vocabulary
    check_json_values(document, max_depth)  a parsed JSON body: nesting depth, valid Unicode, integers in range
    parse_json_int(text)                     json.loads's parse_int: an integer too long to convert stays a TooLongInt
    refuse_keywords(function, given)         a keyword another API takes, answered with this one's equivalent
    HelpFormatter                            argparse help that shows each option's default once

`generate.check_request` (the one check of a whole request), the engine's `SamplingParams` and the server's
`protocol.check_sampling_fields` call these.
"""
from __future__ import annotations

import argparse
import inspect
import math
import numbers

import torch

__all__ = ["is_int", "check_flag", "check_int", "FLOAT32_TINY", "FLOAT32_MAX", "float32_edge", "check_float32",
           "MIN_TEMPERATURE", "SEED_RANGE", "PENALTY_RANGE", "check_sampling", "check_processors",
           "check_token_ids", "InvalidValue", "check_json_values",
           "INT64_MAX", "JSON_INT_RANGE", "TooLongInt", "parse_json_int",
           "KEYWORD_EQUIVALENTS",
           "refuse_keywords", "HelpFormatter"]

# Sampling computes in float32. Below its smallest normal number a value loses precision (a subnormal), and
# below half its smallest subnormal it becomes 0; above its largest it becomes inf.
FLOAT32_TINY = torch.finfo(torch.float32).tiny          # 1.18e-38
FLOAT32_MAX = torch.finfo(torch.float32).max            # 3.40e38
# The smallest temperature sampling takes: logits are divided by it in float32, so a smaller one (1e-300, say)
# becomes 0 there and every logit turns into inf or nan.
MIN_TEMPERATURE = FLOAT32_TINY
SEED_RANGE = (-2**63, 2**64 - 1)          # what torch.Generator.manual_seed takes
PENALTY_RANGE = (-2.0, 2.0)               # presence and frequency penalties, as the OpenAI API bounds them
INT64_MAX = 2**63 - 1                     # the bound of every integer request field without a smaller one
JSON_INT_RANGE = SEED_RANGE               # no integer in a request body may lie outside this (the seed's range)


def is_int(value) -> bool:
    """Whether value is an integer (a bool is not). Chapter 01."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flag(name: str, value) -> bool:
    """Returns value if it is True or False, else raises ValueError naming the option (so "no" never means yes).
    Chapter 01."""
    if value is not True and value is not False:
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__}); pass a bool")
    return value


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """Returns value if it is an integer (not a bool, a float or a string) within [minimum, maximum], else raises
    ValueError naming the option and the range. Chapter 01."""
    bounds = (f" >= {minimum}" if maximum is None else f" in {minimum}..{maximum}") if minimum is not None else \
        (f" <= {maximum}" if maximum is not None else "")
    if not is_int(value):
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer{bounds}, got {value!r}")
    return value


def _shown(value) -> str:
    """repr(value), cut to 40 characters (an integer of 400 digits is still named)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def float32_edge(value) -> str | None:
    """Why float32 cannot hold the number value as itself, or None if it can (0, or a finite magnitude in
    FLOAT32_TINY..FLOAT32_MAX). Chapter 01."""
    try:
        magnitude = abs(value) if is_int(value) else abs(float(value))     # an int exactly, even beyond float64
    except OverflowError:                                                  # a Fraction beyond float64
        magnitude = abs(value)
    if magnitude != magnitude:
        return "is not a number"
    if magnitude == math.inf:
        return "is not finite"
    if magnitude > FLOAT32_MAX:
        return f"is beyond {FLOAT32_MAX:.4g}, the largest float32, where it becomes inf"
    if 0 < magnitude < FLOAT32_TINY:
        becomes = "0" if torch.tensor(float(value), dtype=torch.float32).item() == 0 else "a subnormal number"
        return f"is below {FLOAT32_TINY:.3g}, the smallest normal float32, where it becomes {becomes}"
    return None


def check_float32(name: str, value, fix: str) -> float:
    """Returns value if it is a real number (not a bool) that float32 holds as itself: 0, or a finite magnitude in
    FLOAT32_TINY..FLOAT32_MAX; else raises ValueError naming the option, the limit and `fix`. Chapter 01.

    Sampling computes in float32, so a setting that becomes 0, inf or a subnormal there would divide by 0, overflow
    or lose its precision."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_shown(value)} ({type(value).__name__}); {fix}")
    problem = float32_edge(value)
    if problem is not None:
        raise ValueError(f"{name}={_shown(value)} {problem}; {fix}")
    return value


def check_sampling(max_new_tokens: int = 1, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | None = None, eos_token_id: int | None = None,
                   vocab_size: int | None = None, *, min_p: float | None = None, repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> None:
    """Raise ValueError naming the first sampling or stopping setting that cannot work. Chapter 01.

    temperature, top_p, min_p and the penalties must survive float32, where sampling computes: a subnormal or a
    value that becomes 0 or inf there is refused. min_p lies in 0..1 (0: off), repetition_penalty is > 0 (1: off),
    presence_penalty and frequency_penalty lie in PENALTY_RANGE, -2..2 as in the OpenAI API (0: off). The EOS id is
    checked against vocab_size where it is known (an engine's SamplingParams are made before they meet a model)."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or \
            not (is_int(temperature) or math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {_shown(temperature)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature={temperature!r} is below {MIN_TEMPERATURE:.3g}, the smallest temperature "
                         "sampling can divide float32 logits by (the scaled logits would overflow to inf and nan); "
                         "pass temperature=0 for greedy decoding, which such a temperature amounts to")
    check_float32("temperature", temperature, "pass a temperature of at most 3.4e38 (a temperature far above 1 "
                                              "already samples the top tokens almost uniformly)")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {_shown(top_p)}")
    if top_p is not None:
        check_float32("top_p", top_p, f"pass top_p >= {FLOAT32_TINY:.3g} (any top_p that small keeps only the most "
                                      "likely token, as top_k=1 does)")
    check_processors(min_p, repetition_penalty, presence_penalty, frequency_penalty)
    if seed is not None and not is_int(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed={_shown(seed)} is outside the range a random generator takes, -2**63 .. 2**64 - 1; "
                         "pass a smaller seed (or None)")
    if eos_token_id is None:
        return
    if not is_int(eos_token_id):
        raise ValueError(f"eos_token_id must be an integer token id or None, got {eos_token_id!r}")
    if vocab_size is None and eos_token_id < 0:
        raise ValueError(f"eos_token_id must be a token id >= 0 or None, got {eos_token_id!r}")
    if vocab_size is not None and not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary of {vocab_size} ids "
                         f"(0..{vocab_size - 1}), so generation would never stop on it; pass the tokenizer's "
                         "eos_token_id")


def check_processors(min_p: float | None = None, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0) -> None:
    """Raise ValueError naming the first of min-p and the three penalties that cannot work (check_sampling's part
    for the processors beside temperature, top-k and top-p). Chapter 13."""
    if min_p is not None:
        check_float32("min_p", min_p, "pass min_p from 1.18e-38 to 1, or 0 (or None) for no min-p cut")
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must lie in 0..1 (a fraction of the top token's probability; 0: no cut), "
                             f"got {_shown(min_p)}")
    check_float32("repetition_penalty", repetition_penalty, "pass a penalty > 0, where 1 means none (1.1-1.3 is "
                                                            "typical)")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: none, above 1 discourages repeats, below 1 encourages "
                         f"them), got {_shown(repetition_penalty)}")
    low, high = PENALTY_RANGE
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        check_float32(name, value, f"pass {name} from {low} to {high} (0: none)")
        if not low <= value <= high:
            raise ValueError(f"{name} must lie in {low}..{high}, as in the OpenAI API (0: none), got {_shown(value)}")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError if any id lies outside 0..vocab_size-1 (one host sync: once per request). Chapter 01."""
    lo, hi = torch.aminmax(input_ids.detach())
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary of {vocab_size} ids (valid ids are "
                         f"0..{vocab_size - 1}); was the text encoded by this model's own tokenizer?")


class InvalidValue(ValueError):
    """A ValueError that says where in a request the bad value sits (`param`, e.g. 'messages.0.content'), so a
    server can name it in its 400. Chapter 11."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class TooLongInt(str):
    """The digits of a JSON integer too long to be a request's value, kept as text (never converted: Python refuses
    to convert more than 4,300 digits, and the conversion's cost grows with their square). Chapter 11."""


def parse_json_int(text: str):
    """json.loads's parse_int: the integer, or a TooLongInt for one of more digits than any in JSON_INT_RANGE has
    (20), which check_json_values then refuses naming where it sits. Chapter 11."""
    return int(text) if len(text) <= 21 else TooLongInt(text)


def check_json_values(document, max_depth: int) -> None:
    """Raises InvalidValue for a parsed JSON document nested deeper than max_depth (objects and arrays inside one
    another), holding a string that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON allows but
    UTF-8 cannot encode), or an integer outside JSON_INT_RANGE (a TooLongInt from parse_json_int too). Chapter 11."""
    stack = [(document, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, TooLongInt) or (is_int(value) and not JSON_INT_RANGE[0] <= value <= JSON_INT_RANGE[1]):
            digits = len(value.lstrip("-")) if isinstance(value, TooLongInt) else len(str(abs(value)))
            raise InvalidValue(f"the integer at {where or 'the top level'} has {digits} digits, beyond any value a "
                               f"request takes (integers lie in -2**63 .. 2**64 - 1, and each field has its own "
                               f"limit); send a smaller number", param=where or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidValue(f"the string at {where or 'the top level'} is not valid Unicode ({exc.reason} at "
                                   f"character {exc.start}); send UTF-8 text without lone surrogates",
                                   param=where or None) from None
            continue
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise InvalidValue(f"the JSON body nests deeper than {max_depth} levels at {where}; a request "
                                   f"nests at most {max_depth}", param=where.split(".")[0] or None)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth, where))
                stack.append((item, depth + 1, f"{where}.{key}" if where else str(key)))


# Keywords that other generation APIs (transformers, vLLM, the OpenAI API) take, and this API's equivalent.
KEYWORD_EQUIVALENTS = {
    "do_sample": "sampling is on when temperature > 0 (temperature=0, the default, is greedy); pass temperature=...",
    "max_tokens": "pass max_new_tokens=...",
    "max_length": "it counts the prompt's tokens too; pass max_new_tokens=..., the new tokens alone",
    "num_beams": "beam search is not implemented; drop it (decoding is greedy or sampled)",
}


def refuse_keywords(function, given: dict, takes: list[str] | None = None) -> None:
    """Raises TypeError for the first keyword in `given` (those function received but does not take), naming this
    API's equivalent where KEYWORD_EQUIVALENTS has one, else the keywords it takes (`takes`, or its signature's).
    Chapter 01."""
    for name in given:
        if takes is None:
            takes = [p.name for p in inspect.signature(function).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        hint = KEYWORD_EQUIVALENTS.get(name, f"it takes {', '.join(takes)}")
        raise TypeError(f"{function.__name__}() has no {name}: {hint}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse help that shows an option's default once: appended as "(default: ...)" unless the help already
    says it, and left out where the default is None or an off switch (it says nothing). Chapter 11."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)
