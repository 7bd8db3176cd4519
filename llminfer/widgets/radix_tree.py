"""The radix tree of cached prefixes, drawn. Chapter 13.

`tree_boxes(tree, tokenizer)` is the pure part: one `NodeBox` per node of an `engine.radix_cache.RadixCache`
(its depth, its row, the tokens and blocks of its edge, its lock count, its first tokens as text), laid out
left to right from the root, one row per leaf, a parent centred on its children. `draw_radix_tree` draws
the boxes with matplotlib: an edge's box is as wide as it is long in tokens' worth of blocks, so a prefix
that many requests share is one wide box that every path starts from; a node that running requests lock
is outlined in red, with its lock count.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeBox", "tree_boxes", "draw_radix_tree"]


@dataclass(frozen=True)
class NodeBox:
    """One node as drawn: where it sits and what its label says."""
    depth: int                 # 0 for the root's children
    start_block: int           # blocks from the root to the start of its edge (its x)
    row: float                 # vertical place: leaves 0, 1, 2, ...; a parent the mean of its children
    num_tokens: int
    blocks: tuple[int, ...]
    lock_ref: int
    text: str                  # its tokens from where they part ways with its siblings', decoded (ids without a tokenizer)
    parent: int | None         # index of the parent's box (None under the root)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _text(tokens, siblings, tokenizer, max_chars: int) -> str:
    """The edge's tokens from where it parts ways with its siblings ("…" before when that is not its start)."""
    start = max((_common(tokens, s.tokens) for s in siblings), default=0)
    start = max(0, min(start, len(tokens) - 1) - 1)
    shown = list(tokens[start:start + 24])
    text = " ".join(str(t) for t in shown[:8]) if tokenizer is None else \
        tokenizer.decode(shown, skip_special_tokens=False)
    text = ("…" if start else "") + text.replace("\n", "⏎")
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def tree_boxes(tree, tokenizer=None, max_chars: int = 28) -> list[NodeBox]:
    """The tree's nodes as boxes, parents before children, children in the order of their first tokens."""
    boxes: list[NodeBox] = []
    next_row = [0.0]

    def place(node, depth: int, start_block: int, parent: int | None) -> float:
        index = len(boxes)
        boxes.append(None)                                    # its place, filled once its children are placed
        rows = [place(child, depth + 1, start_block + len(node.blocks), index)
                for _, child in sorted(node.children.items())]
        if rows:
            row = sum(rows) / len(rows)
        else:
            row, next_row[0] = next_row[0], next_row[0] + 1
        siblings = [c for c in node.parent.children.values() if c is not node]
        boxes[index] = NodeBox(depth, start_block, row, len(node.tokens), tuple(node.blocks), node.lock_ref,
                               _text(node.tokens, siblings, tokenizer, max_chars), parent)
        return row

    for _, child in sorted(tree.root.children.items()):
        place(child, 0, 0, None)
    return boxes


def draw_radix_tree(tree, tokenizer=None, ax=None, title: str = ""):
    """Draws the tree on ax (a new figure if None): a box per node, as wide as its blocks, joined to its parent.
    Each box: its tokens from where they part ways with its siblings, its token and block counts, its lock count
    when running requests hold it (L2: two requests; the short form in a narrow box).
    Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    boxes = tree_boxes(tree, tokenizer)
    if ax is None:
        rows = max((b.row for b in boxes), default=0) + 1
        _, ax = plt.subplots(figsize=(11, max(2.5, 0.55 * rows + 1)))
    size = tree.block_size
    end = max((b.start_block + len(b.blocks) for b in boxes), default=1)
    chars_per_block = ax.figure.get_figwidth() * 72 / 4.5 / end    # 7.5-point text is about 4.5 points a character
    for b in boxes:
        x, width = b.start_block, len(b.blocks)
        locked = b.lock_ref > 0
        ax.add_patch(FancyBboxPatch((x + 0.08, b.row - 0.32), max(width - 0.16, 0.2), 0.64,
                                    boxstyle="round,pad=0.02", linewidth=1.6 if locked else 0.8,
                                    edgecolor="#d62728" if locked else "#555555",
                                    facecolor="#fff2cc" if locked else "#dbe9f6"))
        lock = f" · lock {b.lock_ref}" if locked else ""
        fits = max(3, int(width * chars_per_block) - 2)
        text = b.text if len(b.text) <= fits else b.text[:fits - 1] + "…"
        ax.text(x + 0.2, b.row + 0.08, text, fontsize=7.5, va="center", ha="left", clip_on=True)
        counts = f"{b.num_tokens} tokens · {width} block{'s' * (width != 1)}{lock}" if fits >= 24 else \
            f"{b.num_tokens} tok{f' · L{b.lock_ref}' if locked else ''}"
        ax.text(x + 0.2, b.row - 0.17, counts, fontsize=7, va="center", ha="left", color="#333333")
        if b.parent is not None:
            p = boxes[b.parent]
            ax.plot([x, x + 0.08], [p.row, b.row], color="#777777", linewidth=0.8)
    ax.set_xlim(-0.2, end + 0.2)
    ax.set_ylim(max((b.row for b in boxes), default=0) + 0.6, -0.6)
    ax.set_yticks([])
    ax.set_xlabel(f"blocks from the root ({size} tokens each)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"radix tree: {len(boxes)} nodes, {tree.num_blocks} blocks cached")
    return ax
