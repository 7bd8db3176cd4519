"""claims.tokens_agree: float32 runs must give every token; bfloat16 and float16 runs may flip a near-tie now and
then (chapters 04 and 06 take that branch on a GPU, in bfloat16)."""
import pytest
import torch

from llminfer.claims import HALF_PRECISION_AGREEMENT, tokens_agree

A = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
ONE_FLIP = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 99, 98]]   # the last request flips at its 3rd


def test_float32_needs_every_token():
    assert tokens_agree(A, A, torch.float32) == (True, 1.0)
    assert tokens_agree(A, ONE_FLIP, torch.float32) == (False, 14 / 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_precision_branch_allows_a_near_tie(dtype):
    assert tokens_agree(A, ONE_FLIP, dtype) == (True, 14 / 16)
    early = [[1, 99, 98, 97]] + A[1:2] + [[9, 0, 0, 0], [0, 0, 0, 0]]          # most tokens after a flip
    agree, share = tokens_agree(A, early, dtype)
    assert not agree and share == 6 / 16 < HALF_PRECISION_AGREEMENT


def test_a_real_bfloat16_model_takes_the_branch_on_the_cpu():
    import llminfer

    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu", dtype=torch.bfloat16)
    prompt = tokenizer.encode("The capital of France is")
    runs = [llminfer.generate(model, prompt, max_new_tokens=12, ignore_eos=True, use_cache=c).token_ids
            for c in (True, False)]
    agree, share = tokens_agree([runs[0]], [runs[1]], model.dtype)
    assert agree and share >= HALF_PRECISION_AGREEMENT
    assert tokens_agree([runs[0]], [runs[0][:3] + [t + 1 for t in runs[0][3:]]], model.dtype)[0] is False


def test_runs_of_different_requests_are_refused():
    with pytest.raises(ValueError, match="got 4 and 1"):
        tokens_agree(A, A[:1], torch.float32)
