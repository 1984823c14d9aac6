"""The online-softmax step both paged-attention kernels share: one cache block at a time."""

from __future__ import annotations

from meshserve.kernels.triton_import import tl, triton


@triton.jit
def attend_block(q, k_ptr, v_ptr, kv_off, d_mask, valid, m_i, l_i, acc, qk_scale,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one cache block into (m_i, l_i, acc): q [M, D], keys at kv_off [T, D], valid [M, T].

    Scores are in the log2 domain (qk_scale includes log2 e); a row with no valid key
    yet keeps m_i = -inf and adds nothing.
    """
    k = tl.load(k_ptr + kv_off, mask=d_mask[None, :], other=0.0)  # [T, D]
    v = tl.load(v_ptr + kv_off, mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, T]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
