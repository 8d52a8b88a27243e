"""Prompt prefix cache: the KV of recent prompts, reused by a later prompt that starts with the same tokens.

Under causal attention a token's keys and values depend only on the tokens up to it, so the KV a prefill computed
for a prompt's first c tokens is exactly what any prompt with the same first c tokens needs: a chat's next turn
(the conversation so far, then more), several questions after one long system prompt or document, an evaluation
harness scoring one context with each of its continuations. :class:`PrefixCache` keeps, per stored prompt, the KV
of all its tokens but the last (per layer ``[1, H, L - 1, D]``), finds for a new prompt the stored one with the
longest common prefix (at least ``min_tokens``; at most the new prompt's length - 1, so that the prefill still
feeds one token and gets its logits) and evicts the least recently used prompts beyond ``max_tokens`` stored tokens.

The engine (``Engine(prefix_cache=N)``, ``dlm serve --prefix-cache-tokens N``) stores each prefilled prompt and
each finished request's prompt + output (its live cache slots; not with ``static_cache``, whose buffers are laid out
differently), starts a prefill from the cached KV and feeds only the rest of the prompt; decoders that are not causal, and requests that ask for the
prompt's log-probabilities (which need the logits of every prompt position), always prefill in full.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dlm.errors import DLMError

MIN_TOKENS = 16  # shorter common prefixes are not worth a lookup hit's copy
DEFAULT_TOKENS = 4096  # the commands' default budget (SmolLM2-135M's KV in fp32: 45 KB a token, 180 MB)


def check_tokens(n) -> int:
    """``n`` as a prefix-cache budget (``--prefix-cache-tokens``), or a DLMError naming the flag."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DLMError(f"--prefix-cache-tokens must be an integer >= 0 (0 = off), got {n}")
    return n


class PrefixCache:
    """See the module docstring. ``hits`` / ``reused_tokens`` count lookups that found a prefix and the tokens they
    did not recompute."""

    def __init__(self, max_tokens: int, min_tokens: int = MIN_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens, self.min_tokens = max_tokens, max(1, min_tokens)
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]]
        self._entries = OrderedDict()
        self.stored_tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """(c, per-layer KV of at least c tokens) for the stored prompt sharing the longest prefix with ``prompt``
        (c >= ``min_tokens``, c < len(prompt)), or None."""
        limit = len(prompt) - 1
        if limit < self.min_tokens or not self._entries:
            return None
        query = torch.tensor(prompt[:limit], dtype=torch.long)
        best, best_key = 0, None
        for key, (ids, _) in self._entries.items():
            m = min(limit, ids.numel())
            if m <= best:
                continue
            same = (ids[:m] == query[:m]).to(torch.int8)
            c = m if bool(same.all()) else int(same.argmin())
            if c > best:
                best, best_key = c, key
        if best_key is None or best < self.min_tokens:
            return None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return best, self._entries[best_key][1]

    def store(self, prompt: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of ``prompt[:-1]`` (``layers``: per layer keys / values ``[1, H, >= L - 1, D]``, copied)."""
        key = tuple(prompt[:-1])
        n = len(key)
        if n < self.min_tokens or n > self.max_tokens:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        kv = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in layers]
        self._entries[key] = (torch.tensor(key, dtype=torch.long), kv)
        self.stored_tokens += n
        while self.stored_tokens > self.max_tokens and self._entries:
            _, (ids, _) = self._entries.popitem(last=False)
            self.stored_tokens -= ids.numel()
