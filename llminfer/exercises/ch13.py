"""Chapter 13's exercises: the tokens a regex allows first, what top-p keeps, a prefix matched in the radix
tree."""
from __future__ import annotations

from . import as_whole, exercise, not_a

FIRST_PATTERN = "(true|false)"                      # 13.1
PROBS, TOP_P = (0.4, 0.3, 0.2, 0.1), 0.75           # 13.2
BLOCK_SIZE = 2                                      # 13.3: section 5's tree and the prompt matched against it
INSERTED = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 7, 8))
PROMPT = (1, 2, 3, 9)


def _first_tokens() -> list[bytes]:
    from ..checkpoint import load_tokenizer
    from ..structured import Vocabulary, compile_index
    vocab = Vocabulary.from_tokenizer(load_tokenizer("smollm2-135m-instruct"))
    index = compile_index(FIRST_PATTERN, vocab)
    return [vocab.token_bytes[t] for t in index.allowed_tokens(index.dfa.initial)]


@exercise("13.1", "how many of SmolLM2's tokens (true|false) allows as the first")
def first_tokens(answer):
    count = as_whole(answer)
    if count is None or count < 0:
        return not_a("a number of tokens", answer)
    allowed = _first_tokens()
    if count == len(allowed):
        return True, f"{len(allowed)} tokens: {', '.join(repr(b.decode()) for b in sorted(allowed))}"
    if count == 2:
        return False, ("2 counts the first characters; every token whose bytes are a prefix of 'true' or 'false' "
                       "keeps the text alive ('tr', 'true', ...): walk each token's bytes (section 2)")
    if count > len(allowed):
        return False, ("too many: a token is allowed only if all its bytes stay in the automaton, so ' true' (with "
                       "its space) or 'True' is not (section 2)")
    return False, "too few: count every token whose bytes are a prefix of 'true' or 'false' (section 2)"


def _kept() -> int:
    import torch
    from ..sampling import apply_top_p
    logits = torch.tensor([PROBS]).log()
    return int(apply_top_p(logits, [TOP_P]).isfinite().sum())


@exercise("13.2", "how many of the probabilities 0.4, 0.3, 0.2, 0.1 top-p 0.75 keeps")
def top_p_kept(answer):
    kept = as_whole(answer)
    if kept is None or not 0 <= kept <= len(PROBS):
        return not_a(f"a whole number from 0 to {len(PROBS)}", answer)
    want = _kept()
    if kept == want:
        return True, f"0.4 + 0.3 = 0.7 falls short of {TOP_P}; with 0.2 the kept mass reaches 0.9: {want} tokens"
    if kept == want - 1:
        return False, (f"the kept set must reach {TOP_P}: the smallest set of most likely tokens whose probability "
                       "adds up to at least p (section 1), and 0.7 does not")
    return False, f"add the probabilities, most likely first, until the sum reaches {TOP_P} (section 1)"


def _cached() -> int:
    from ..engine import RadixCache
    tree = RadixCache(BLOCK_SIZE)
    first_block = 0
    for tokens in INSERTED:
        tree.insert(tokens, list(range(first_block, first_block + len(tokens) // BLOCK_SIZE)))
        first_block += len(tokens) // BLOCK_SIZE
    return tree.match_prefix(PROMPT).num_tokens


@exercise("13.3", "how many tokens of [1, 2, 3, 9] section 5's radix tree holds")
def radix_match(answer):
    tokens = as_whole(answer)
    if tokens is None or not 0 <= tokens <= len(PROMPT):
        return not_a(f"a whole number of tokens from 0 to {len(PROMPT)}", answer)
    want = _cached()
    if tokens == want:
        return True, (f"{want}: the block [1 2] matches; [3 9] differs from the cached [3 4], and a block's K/V "
                      "is reused whole or not at all")
    if tokens == 3:
        return False, (f"3 tokens agree, but the tree caches whole blocks of {BLOCK_SIZE}: the block [3 9] is not "
                       "[3 4] (section 5)")
    return False, "walk down from the root block by block while the prompt's blocks equal the edge's (section 5)"
