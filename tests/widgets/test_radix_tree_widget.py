"""Chapter 13's drawing of the radix tree: the layout of a hand-built tree, and the figure drawn from it."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from llminfer.engine.radix_cache import RadixCache   # noqa: E402
from llminfer.widgets.radix_tree import draw_radix_tree, tree_boxes   # noqa: E402


def hand_built_tree() -> RadixCache:
    """block_size 2: 1 2 3 4 shared by three paths, two of which go on with 7 8; 5 6 locked by a running request."""
    tree = RadixCache(block_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    tree.insert([1, 2, 3, 4, 7, 8, 9, 9], [3, 4, 5, 6])
    tree.insert([1, 2, 3, 4, 7, 8, 1, 1], [7, 8, 9, 10])
    tree.insert([4, 4], [11])
    tree.lock(tree.match_prefix([1, 2, 3, 4, 5, 6]).node)
    return tree


def test_boxes_put_a_shared_prefix_once_with_its_branches_after_it():
    boxes = tree_boxes(hand_built_tree())
    spans = [(b.depth, b.start_block, len(b.blocks), b.num_tokens, b.lock_ref, b.parent) for b in boxes]
    # parents before children, children in the order of their first tokens; rows: leaves 0, 1, 2, 3
    assert spans == [(0, 0, 2, 4, 1, None),        # 1 2 3 4: three paths start from it, one request locks it
                     (1, 2, 1, 2, 1, 0),           # 5 6, locked
                     (1, 2, 1, 2, 0, 0),           # 7 8, split where 1 1 and 9 9 part ways
                     (2, 3, 1, 2, 0, 2),           # 1 1
                     (2, 3, 1, 2, 0, 2),           # 9 9
                     (0, 0, 1, 2, 0, None)]        # 4 4
    assert [b.row for b in boxes] == [0.75, 0.0, 1.5, 1.0, 2.0, 3.0]   # a parent in the middle of its children
    assert [b.text for b in boxes] == ["1 2 3 4", "5 6", "7 8", "1 1", "9 9", "4 4"]


def test_a_label_starts_where_siblings_part_ways():
    tree = RadixCache(block_size=4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    tree.insert([1, 2, 3, 4, 5, 6, 9, 9], [2, 3])
    assert [b.text for b in tree_boxes(tree)] == ["1 2 3 4", "…6 7 8", "…6 9 9"]


def test_the_figure_has_a_box_per_node_and_a_line_per_edge():
    ax = draw_radix_tree(hand_built_tree(), title="after the workload")
    assert len(ax.patches) == 6 and len(ax.lines) == 4 and ax.get_title() == "after the workload"
    texts = [t.get_text() for t in ax.texts]
    assert "4 tokens · 2 blocks · lock 1" in texts
    matplotlib.pyplot.close(ax.figure)
