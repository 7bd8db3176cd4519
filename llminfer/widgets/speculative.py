"""Speculative decoding, token by token: which guesses stood, and what that saved. Chapter 09.

Every change of a control runs `llminfer.speculative.generate` on the reader's device, and plain
`llminfer.generate` beside it for the speedup, then draws the result with pure functions:

- ``token_html(pieces, kinds)``: the generated text, one coloured span per token: accepted guess, the target's
  token at a rejected guess (resampled), the bonus token after all k guesses stood, or the target alone;
- ``run_summary(result, plain_s_per_token, spec_s_per_token)``: acceptance, tokens per forward and speedup of one run;
- ``format_run(summary)``: the line for this run, e.g.
  ``"k=4 · accepted 12 of 16 guesses (75.0%) · 3.40 tokens per target forward · 1.85× plain decoding's speed"``;
- ``Totals`` / ``format_totals(totals)``: the running totals over every run since the widget opened, e.g.
  ``"3 runs · accepted 30 of 44 guesses (68.2%) · 2.10× plain decoding's speed overall"``.

Speed is compared per generated token (end-to-end time over tokens, medians over `repeats` runs of each),
so that sampled runs of different lengths compare fairly; for greedy runs the tokens are the same.

CSS classes for browser tests: ``llminfer-spec-k`` (the k slider), ``llminfer-spec-drafter`` (the drafter
choice), ``llminfer-spec-temperature`` (the temperature slider), ``llminfer-spec-prompt`` (the prompt),
``llminfer-spec-text`` (the coloured text), ``llminfer-spec-run`` (this run's line), ``llminfer-spec-totals``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..speculative import ACCEPTED, BONUS, RESAMPLED, TARGET

COLOURS = {ACCEPTED: "#2e7d32", RESAMPLED: "#c62828", BONUS: "#1565c0", TARGET: "#757575"}
LABELS = {ACCEPTED: "accepted guess", RESAMPLED: "rejected guess, the target's token instead",
          BONUS: "bonus token (all guesses stood)", TARGET: "the target alone (prefill, or nothing guessed)"}


def token_html(pieces: list[str], kinds: list[str]) -> str:
    """The generated text as spans coloured by each token's origin, with a legend. Chapter 09."""
    if len(pieces) != len(kinds):
        raise ValueError(f"{len(pieces)} token pieces but {len(kinds)} kinds; pass one kind per token")
    spans = []
    for piece, kind in zip(pieces, kinds):
        if kind not in COLOURS:
            raise ValueError(f"unknown token kind {kind!r}; expected one of {sorted(COLOURS)}")
        spans.append(f"<span class='spec-{kind}' title='{LABELS[kind]}' style='background:{COLOURS[kind]};"
                     f"color:white;padding:1px 2px;margin:1px;border-radius:3px;white-space:pre'>"
                     f"{html.escape(piece)}</span>")
    legend = " ".join(f"<span style='background:{COLOURS[k]};color:white;padding:1px 6px'>{LABELS[k]}</span>"
                      for k in (ACCEPTED, RESAMPLED, BONUS, TARGET))
    return f"<div style='line-height:1.9;font-family:monospace'>{''.join(spans)}</div><div>{legend}</div>"


def run_summary(result, plain_s_per_token: float, spec_s_per_token: float) -> dict:
    """What one run did: k, guesses drafted and accepted, tokens per target forward, speedup. Chapter 09."""
    return {"k": result.num_speculative_tokens, "drafted": result.num_drafted, "accepted": result.num_accepted,
            "tokens": len(result.token_ids), "steps": result.num_steps, "tokens_per_step": result.tokens_per_step,
            "plain_s_per_token": plain_s_per_token, "spec_s_per_token": spec_s_per_token,
            "speedup": plain_s_per_token / spec_s_per_token}


def _share(accepted: int, drafted: int) -> str:
    return f"{accepted / drafted:.1%}" if drafted else "no guesses"


def format_run(summary: dict) -> str:
    """This run's line: k, accepted of drafted guesses, tokens per target forward, speedup. Chapter 09."""
    per_step = summary["tokens_per_step"]
    per_step_text = f"{per_step:.2f}" if per_step == per_step else "–"
    return (f"k={summary['k']} · accepted {summary['accepted']} of {summary['drafted']} guesses "
            f"({_share(summary['accepted'], summary['drafted'])}) · {per_step_text} tokens per target forward · "
            f"{summary['speedup']:.2f}× plain decoding's speed")


@dataclass
class Totals:
    """Running totals over every run since the widget opened. Chapter 09."""

    runs: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    plain_s: float = 0.0             # per-token time × tokens, summed: what plain decoding would have taken
    spec_s: float = 0.0
    history: list = field(default_factory=list)

    def add(self, summary: dict) -> "Totals":
        """Adds one run's summary; returns self."""
        self.runs += 1
        self.drafted += summary["drafted"]
        self.accepted += summary["accepted"]
        self.tokens += summary["tokens"]
        self.plain_s += summary["plain_s_per_token"] * summary["tokens"]
        self.spec_s += summary["spec_s_per_token"] * summary["tokens"]
        self.history.append(summary)
        return self

    @property
    def speedup(self) -> float:
        return self.plain_s / self.spec_s if self.spec_s else float("nan")


def format_totals(totals: Totals) -> str:
    """The running-totals line, e.g. '3 runs · accepted 30 of 44 guesses (68.2%) · 2.10× ... overall'. Chapter 09."""
    return (f"{totals.runs} run{'s' if totals.runs != 1 else ''} · accepted {totals.accepted} of {totals.drafted} "
            f"guesses ({_share(totals.accepted, totals.drafted)}) · {totals.speedup:.2f}× plain decoding's "
            "speed overall")


def timed_pair(model, input_ids, drafter, k: int, max_new_tokens: int, temperature: float, eos_token_id,
               seed: int, repeats: int = 3):
    """(first speculative result, median plain s/token, median speculative s/token): the two take turns, one run
    each per round (`llminfer.timing.interleave`), round i seeded seed + i on both sides. Chapter 09."""
    import llminfer
    from llminfer import speculative, timing

    calls = {"speculative": 0, "plain": 0}

    def next_seed(kind: str) -> int:
        calls[kind] += 1
        return seed + calls[kind] - 1

    contenders = {
        "speculative": lambda: speculative.generate(model, input_ids, drafter, num_speculative_tokens=k,
                                                    max_new_tokens=max_new_tokens, temperature=temperature,
                                                    eos_token_id=eos_token_id, seed=next_seed("speculative")),
        "plain": lambda: llminfer.generate(model, input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                           eos_token_id=eos_token_id, ignore_eos=eos_token_id is None,
                                           seed=next_seed("plain"))}
    # no warm-up: the widget runs on a model that has decoded already, and the median leaves out a slow first run
    runs = timing.interleave(contenders, repeats, warmup=0)
    per_token = timing.medians(runs, lambda run: run.e2e_s / max(len(run.token_ids), 1))
    return runs["speculative"][0], per_token["plain"], per_token["speculative"]


@dataclass
class SpeculativeState:
    """What the widget shows right now. Chapter 09."""

    result: object
    summary: dict
    run_text: str
    totals_text: str


def build_speculative_widget(model, tokenizer, drafters: dict, prompt: str, k: int = 4, max_new_tokens: int = 24,
                             repeats: int = 3, max_k: int = 8):
    """A VBox: prompt, drafter, k and temperature controls, the coloured text, this run, the totals. Chapter 09."""
    import ipywidgets as widgets

    if not drafters:
        raise ValueError("drafters is empty; pass a dict of name -> drafter, e.g. {'prompt lookup': "
                         "PromptLookupDrafter()}")
    prompt_box = widgets.Text(value=prompt, description="prompt", continuous_update=False,
                              layout=widgets.Layout(width="760px"))
    prompt_box.add_class("llminfer-spec-prompt")
    drafter_choice = widgets.Dropdown(options=list(drafters), description="drafter")
    drafter_choice.add_class("llminfer-spec-drafter")
    wide = {"description_width": "initial"}                                  # labels in full
    k_slider = widgets.IntSlider(value=k, min=1, max=max_k, description="k (guesses)", style=wide)
    k_slider.add_class("llminfer-spec-k")
    temperature_slider = widgets.FloatSlider(value=0.0, min=0.0, max=1.5, step=0.1, description="temperature",
                                             continuous_update=False, style=wide)
    temperature_slider.add_class("llminfer-spec-temperature")
    text_view = widgets.HTML()
    text_view.add_class("llminfer-spec-text")
    run_view = widgets.HTML()
    run_view.add_class("llminfer-spec-run")
    totals_view = widgets.HTML()
    totals_view.add_class("llminfer-spec-totals")
    box = widgets.VBox([prompt_box, widgets.HBox([drafter_choice, k_slider, temperature_slider]), text_view,
                        run_view, totals_view])
    box.add_class("llminfer-spec")
    totals = Totals()

    def refresh(_change=None):
        ids = tokenizer.encode(prompt_box.value)
        if not ids:
            run_view.value = "type a prompt"
            return
        if len(ids) >= model.config.max_seq_len:
            run_view.value = (f"the prompt has {len(ids)} tokens but the model's max_seq_len is "
                              f"{model.config.max_seq_len}, leaving no room for new tokens; shorten it")
            return
        try:
            result, plain_s, spec_s = timed_pair(model, ids, drafters[drafter_choice.value], k_slider.value,
                                                 min(max_new_tokens, model.config.max_seq_len - len(ids)),
                                                 temperature_slider.value, tokenizer.eos_token_id,
                                                 seed=totals.runs, repeats=repeats)
        except ValueError as exc:          # e.g. a prompt longer than the model's context
            run_view.value = html.escape(str(exc))
            return
        summary = run_summary(result, plain_s, spec_s)
        totals.add(summary)
        box.state = SpeculativeState(result, summary, format_run(summary), format_totals(totals))
        text_view.value = token_html(tokenizer.tokens(result.token_ids), result.token_kinds)
        run_view.value = box.state.run_text
        totals_view.value = box.state.totals_text

    for control in (prompt_box, drafter_choice, k_slider, temperature_slider):
        control.observe(refresh, names="value")
    refresh()
    box.prompt_box, box.drafter_choice, box.k_slider, box.temperature_slider = (prompt_box, drafter_choice, k_slider,
                                                                                temperature_slider)
    box.text_view, box.run_view, box.totals_view, box.totals = text_view, run_view, totals_view, totals
    return box
