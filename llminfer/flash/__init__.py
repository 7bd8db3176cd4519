"""FlashAttention from the ground up: online softmax, tiled attention, and a Triton kernel. Chapter 07.

Importing this package registers the Triton kernel as the 'flash' attention backend, so a model runs
it with `attn_backend='flash'` (or `model.set_attention_backend('flash')`). Triton itself is imported only
when the kernel first runs: the torch parts work without it. The native CPU backend is `llminfer.cpu`.
"""
from llminfer.attention import register_backend

from .online_softmax import OnlineSoftmaxStep, merge_states, online_softmax, online_softmax_steps, softmax_state
from .tiled import (HBMTraffic, TiledOutput, TileStep, combine_partials, flash_io_elements, naive_attention,
                    split_kv_attention, standard_io_elements, tile_grid, tiled_attention)
from .triton_flash import (FlashOutput, default_blocks, flash_attention, flash_backend, flash_decode,
                           flash_tile_counts, interpreted, padded_head_dim, triton_available)

register_backend("flash", flash_backend)

__all__ = [
    "online_softmax", "online_softmax_steps", "softmax_state", "merge_states", "OnlineSoftmaxStep",
    "HBMTraffic", "TiledOutput", "TileStep", "naive_attention", "tiled_attention", "split_kv_attention",
    "combine_partials", "tile_grid", "standard_io_elements", "flash_io_elements",
    "FlashOutput", "flash_attention", "flash_decode", "flash_tile_counts", "flash_backend", "interpreted",
    "triton_available", "default_blocks", "padded_head_dim",
]
