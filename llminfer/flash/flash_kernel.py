"""The FlashAttention-2 forward kernel in Triton, written with plain pointer arithmetic. Chapter 07.

Importing this module imports triton. Whether triton.jit compiles the kernel or hands it to the
interpreter is decided by TRITON_INTERPRET at that moment, once per process, because Triton's own
library functions (tl.zeros, tl.max, tl.sum, ...) are wrapped when triton itself is imported.
llminfer.flash.triton_flash imports this module on first use and checks the mode against the tensors.

One program handles one block of BLOCK_M query rows of one (batch, head) and one slice of the keys
(the whole key range unless the call splits it, as flash-decoding does). It walks its keys in tiles
of BLOCK_N, keeping the running max and sum of the online softmax, in log2 units, for each row.
Addresses are base + offsets × strides with masked loads and stores: no block pointers and no tensor
descriptors, so the same source runs on the interpreter and through the compiler.
"""
import triton
import triton.language as tl

__all__ = ["flash_forward"]


@triton.jit
def flash_forward(
    Q, K, V, O, LSE, MASK, COUNTS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_os, stride_ob, stride_oh, stride_om, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    n_heads, n_groups, seq_q, seq_k, head_dim, split_len, qk_scale,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, COUNT_TILES: tl.constexpr, IEEE_DOT: tl.constexpr, WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)                 # which block of query rows
    pid_bh = tl.program_id(1)                # which (batch, query head)
    split = tl.program_id(2)                 # which slice of the keys (flash-decoding); 0 when not split
    batch = (pid_bh // n_heads).to(tl.int64)
    head = (pid_bh % n_heads).to(tl.int64)
    kv_head = head // n_groups               # GQA: the K/V head this query head reads

    # offsets in int64: addresses of long sequences overflow int32 (and 64-bit sums skip the interpreter's
    # overflow checks, which would otherwise cost more than the arithmetic)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)   # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)             # (BLOCK_N,) keys within a tile
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)             # (BLOCK_D,) head lanes, padded to a power of two
    row_ok = offs_m < seq_q
    d_ok = offs_d < head_dim

    q_ptrs = Q + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)        # (BLOCK_M, BLOCK_D)
    if WIDEN:   # see llminfer.flash.triton_flash: bfloat16 tiles are widened to float32 under the interpreter
        q = q.to(tl.float32)
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)     # m, in log2 units
    row_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)               # l
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)          # unnormalised output

    offset = seq_k - seq_q                   # query i sits at key position offset + i
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_k)
    if CAUSAL:
        hi = tl.minimum(hi, offset + (pid_m + 1) * BLOCK_M)         # tiles above the diagonal are never loaded
    n_tiles = 0
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                       # (BLOCK_N,) absolute key positions
        col_ok = cols < hi
        k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)           # (BLOCK_D, BLOCK_N): Kᵀ tile
        if WIDEN:
            k = k.to(tl.float32)
        if IEEE_DOT:   # float32 in full precision: the default on NVIDIA GPUs rounds the inputs to tf32
            s = tl.dot(q, k, input_precision="ieee") * qk_scale             # (BLOCK_M, BLOCK_N), log2 units
        else:
            s = tl.dot(q, k) * qk_scale
        visible = row_ok[:, None] & col_ok[None, :]
        if HAS_MASK:
            m_ptrs = (MASK + batch * stride_mb + head * stride_mh + offs_m[:, None] * stride_mm
                      + cols[None, :] * stride_mn)
            visible = visible & (tl.load(m_ptrs, mask=visible, other=0) != 0)
        elif CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)      # a row with nothing visible yet
        p = tl.exp2(s - ref[:, None])                               # (BLOCK_M, BLOCK_N)
        rescale = tl.exp2(row_max - ref)                            # exp(m - m'): moves l and acc to the new max
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)           # (BLOCK_N, BLOCK_D)
        if WIDEN:      # P rounded to bfloat16 as the compiled kernel does, then widened (exactly) again
            acc = acc * rescale[:, None] + tl.dot(p.to(tl.bfloat16).to(tl.float32), v.to(tl.float32),
                                                  input_precision="ieee")
        elif IEEE_DOT:
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)       # half-precision P, as FlashAttention
        row_max = new_max
        n_tiles += 1

    seen = row_sum > 0.0                                              # False for a row that saw no key
    safe_sum = tl.where(seen, row_sum, 1.0)
    out = acc / safe_sum[:, None]                                     # ... whose output stays 0
    lse = tl.where(seen, (row_max + tl.log2(safe_sum)) * 0.6931471805599453, float("-inf"))  # natural log
    o_ptrs = (O + split * stride_os + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + split * stride_ls + batch * stride_lb + head * stride_lh + offs_m * stride_lm, lse, mask=row_ok)
    if COUNT_TILES:
        n_programs_m = tl.num_programs(0)
        n_programs_bh = tl.num_programs(1)
        tl.store(COUNTS + (split * n_programs_bh + pid_bh) * n_programs_m + pid_m, n_tiles)
