"""The `transformers` contender of the benchmark, on the very weights llminfer runs. Chapter 04.

`transformers` is a test-time peer, never a dependency: it is imported here, inside the functions, only
when the benchmark asks for it; without it the benchmark runs and says the contender was skipped.
"""
from __future__ import annotations

import tempfile

import torch

from ..checkpoint import save_pretrained
from ..generate import GenerationResult, TokenTimer

__all__ = ["load_same_weights", "generate"]


def load_same_weights(model) -> tuple[object | None, str]:
    """Returns (transformers model with model's weights, a note), or (None, why not). Chapter 04."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install transformers); its contenders were skipped"
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="llminfer-bench-") as folder:
        save_pretrained(model, folder)                     # config.json + model.safetensors, Hugging Face layout
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype)
    hf_model = hf_model.to(model.device).eval()
    attention = getattr(hf_model.config, "_attn_implementation", "default")
    return hf_model, (f"transformers {transformers.__version__}, {type(hf_model).__name__}, attention={attention}, "
                      "loaded from llminfer.save_pretrained of the same weights")


def _stamp_processor(timer: TokenTimer):
    from transformers import LogitsProcessor

    class StampEachToken(LogitsProcessor):
        """Records the time each next-token distribution is ready (once per generated token)."""

        def __call__(self, input_ids, scores):
            timer.token()
            return scores

    return StampEachToken()


@torch.inference_mode()
def generate(hf_model, ids: torch.Tensor, new_tokens: int, use_cache: bool) -> GenerationResult:
    """Greedy transformers `generate`, timed like llminfer's own loop: the same GenerationResult. Chapter 04."""
    from transformers import LogitsProcessorList

    timer = TokenTimer(ids.device)
    timer.start()
    out = hf_model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None,
        logits_processor=LogitsProcessorList([_stamp_processor(timer)]))
    rows = out[:, ids.shape[1]:].tolist()
    return timer.result(rows[0] if len(rows) == 1 else rows, ids.shape[1], use_cache)
