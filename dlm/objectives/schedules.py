"""Noise and annealing schedules (docs/algorithms.md#masked-diffusion, §2.1). Randomness always comes from a passed ``torch.Generator``."""

from __future__ import annotations

import torch


def _rand(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """U(0,1) drawn on the generator's device (so a CPU generator is reproducible whatever the model device)."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def sample_t(
    shape, eps: float = 1e-3, antithetic: bool = False, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """Noise levels ``t = (1 - eps) * u + eps`` with ``u ~ U(0, 1)`` (linear schedule alpha_t = 1 - t).

    ``antithetic``: stratified draws over the first dimension, ``u_i = (u_0 + i / n) mod 1`` (one uniform
    shared by the batch; each sample lands in its own 1/n stratum), a cheap variance reduction.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if antithetic:
        n = shape[0]
        u0 = _rand((1,) + shape[1:], generator, device)
        offsets = (torch.arange(n, device=device, dtype=u0.dtype) / n).view((n,) + (1,) * (len(shape) - 1))
        u = (u0 + offsets) % 1.0
    else:
        u = _rand(shape, generator, device)
    return (1 - eps) * u + eps


def anneal_p(step: int, anneal_steps: int) -> float:
    """DiffuLLaMA attention annealing: ``p = min(1, (step + 1) / anneal_steps)``; ``anneal_steps <= 0`` = full."""
    if anneal_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / anneal_steps)


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    t: torch.Tensor,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each maskable token by the mask id independently with probability ``t`` (broadcast to [B, L]).

    Returns ``(x_t, masked)``.
    """
    u = _rand(input_ids.shape, generator, input_ids.device)
    masked = maskable & (u < t)
    return torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids), masked
