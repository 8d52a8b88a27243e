import torch


def rms_norm_fn(x, weight, bias=None, eps=1e-6, **_):
    # the float32 RMSNorm SDAR's file keeps (commented) beside its flash call
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
