"""CPU stand-in for the flash-attn calls SDAR's modeling file makes: the same maths through PyTorch."""

import torch.nn.functional as F


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, **_):
    # flash layout (b, l, h, d); grouped-query heads repeated as flash-attn does
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


flash_attn_varlen_func = None
