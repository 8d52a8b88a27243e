"""Prompt prefix cache: the KV of recent prompts, reused by a later prompt that starts with the same tokens.

Under causal attention a token's keys and values depend only on the tokens up to it, so the KV a prefill computed
for a prompt's first c tokens is exactly what any prompt with the same first c tokens needs: a chat's next turn
(the conversation so far, then more), several questions after one long system prompt or document, an evaluation
harness scoring one context with each of its continuations. :class:`PrefixCache` keeps the KV of stored prompts'
tokens (all but each prompt's last) in a radix tree: a node holds the KV of a run of tokens (per layer
``[1, H, run, D]``) and its children the runs that follow it, so prompts that share a beginning share its KV - a
conversation's turns, each stored whole, take the room of the longest. A lookup walks the tree along the new
prompt and answers the longest stored prefix (at least ``min_tokens``; at most the prompt's length - 1, so that the
prefill still feeds one token and gets its logits), its KV joined from the nodes on the way, in time that grows
with the prompt, not with what is stored. Beyond ``max_tokens`` stored tokens the least recently used leaves go
(a leaf: the end of a stored sequence no other continues). SGLang's RadixAttention keeps its KV pages the same way;
here the tree holds copies, since the engine's batch cache is not paged.

The engine (``EngineOptions(prefix_cache=N)``, ``dlm serve --prefix-cache-tokens N``) stores each prefilled prompt and
each finished request's prompt + output (its live cache slots; not with ``static_cache``, whose buffers are laid out
differently), starts a prefill from the cached KV and feeds only the rest of the prompt; decoders that are not causal, and requests that ask for the
prompt's log-probabilities (which need the logits of every prompt position), always prefill in full.
"""

from __future__ import annotations

import torch

MIN_TOKENS = 16  # shorter common prefixes are not worth a lookup hit's copy


class _Node:
    """A run of tokens after its parent's, with their KV (per layer keys / values ``[1, H, len(tokens), D]``)."""

    __slots__ = ("tokens", "kv", "children", "parent", "used")

    def __init__(self, tokens: tuple[int, ...], kv: list[tuple[torch.Tensor, torch.Tensor]], parent: _Node | None):
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[int, _Node] = {}  # by the first token of the child's run
        self.used = 0  # the cache's clock when a lookup or store last went through it

    def split(self, at: int) -> _Node:
        """Cut this run after its first ``at`` tokens: a new node with those is put between the parent and this
        node, which keeps the rest; returns the new node. Both halves are copied, so each frees its own memory."""
        assert self.parent is not None and 0 < at < len(self.tokens)
        head = _Node(self.tokens[:at], [(k[:, :, :at].clone(), v[:, :, :at].clone()) for k, v in self.kv], self.parent)
        self.parent.children[self.tokens[0]] = head
        self.tokens, self.parent = self.tokens[at:], head
        self.kv = [(k[:, :, at:].clone(), v[:, :, at:].clone()) for k, v in self.kv]
        head.children[self.tokens[0]] = self
        return head


def _common(a: tuple[int, ...], b: list[int], start: int, stop: int) -> int:
    """How many of ``a``'s tokens equal ``b[start:stop]``'s, from the first on."""
    n = min(len(a), stop - start)
    if tuple(b[start : start + n]) == a[:n]:
        return n
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixCache:
    """See the module docstring. ``stored_tokens``: the tokens whose KV is kept (each once); ``hits`` /
    ``reused_tokens`` count lookups that found a prefix and the tokens they did not recompute."""

    def __init__(self, max_tokens: int, min_tokens: int = MIN_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens, self.min_tokens = max_tokens, max(1, min_tokens)
        self._root = _Node((), [], None)
        self._clock = 0
        self.stored_tokens = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        """The stored sequences that no other continues (the tree's leaves)."""
        return sum(1 for n in self._nodes() if not n.children)

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _walk(self, tokens: list[int], stop: int) -> tuple[list[tuple[_Node, int]], int]:
        """The nodes along ``tokens[:stop]`` with how many of each one's tokens match, and the tokens matched."""
        self._clock += 1
        node, i, path = self._root, 0, []
        while i < stop:
            child = node.children.get(tokens[i])
            if child is None:
                break
            m = _common(child.tokens, tokens, i, stop)
            if m == len(child.tokens):  # a run matched in part is touched by the caller (a lookup; a store splits it)
                child.used = self._clock
            path.append((child, m))
            i += m
            if m < len(child.tokens):
                break
            node = child
        return path, i

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """(c, per-layer KV of the first c tokens) for the longest stored prefix of ``prompt`` (c >= ``min_tokens``,
        c < len(prompt)), or None."""
        limit = len(prompt) - 1
        if limit < self.min_tokens or not self._root.children:
            return None
        path, c = self._walk(prompt, limit)
        if c < self.min_tokens:
            return None
        path[-1][0].used = self._clock
        self.hits += 1
        self.reused_tokens += c
        layers = []
        for i in range(len(path[0][0].kv)):
            ks = [node.kv[i][0][:, :, :m] for node, m in path]
            vs = [node.kv[i][1][:, :, :m] for node, m in path]
            layers.append((torch.cat(ks, dim=2), torch.cat(vs, dim=2)) if len(path) > 1 else (ks[0], vs[0]))
        return c, layers

    def store(self, prompt: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of ``prompt[:-1]`` (``layers``: per layer keys / values ``[1, H, >= L - 1, D]``); only the
        tokens the tree does not hold yet are copied."""
        n = len(prompt) - 1
        if n < self.min_tokens or n > self.max_tokens:
            return
        path, i = self._walk(prompt, n)
        node = self._root
        if path:
            last, m = path[-1]
            if m < len(last.tokens):
                node = last.split(m)  # the part the prompt shares is used now; the rest keeps its time
                node.used = self._clock
            else:
                node = last
        if i < n:
            leaf = _Node(tuple(prompt[i:n]), [(k[:, :, i:n].clone(), v[:, :, i:n].clone()) for k, v in layers], node)
            leaf.used = self._clock
            node.children[leaf.tokens[0]] = leaf
            self.stored_tokens += n - i
        while self.stored_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used leaf (its parent may become a leaf in turn)."""
        leaf = min((n for n in self._nodes() if not n.children), key=lambda n: n.used)
        assert leaf.parent is not None
        del leaf.parent.children[leaf.tokens[0]]
        self.stored_tokens -= len(leaf.tokens)
