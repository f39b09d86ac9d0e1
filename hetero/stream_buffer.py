"""Which streamed layers a stage holds on its device: the one buffer policy the runtime follows and the planner
can count with (weight streaming, issue 26; runtime/stage/streaming.py). Torch-free.

A stage keeps at most ``BUFFER_LAYERS`` streamed layers' frozen weights on the device: the layer in use and the
next one in the direction of travel (forward l -> l+1, backward l -> l-1; a recomputed layer's second forward
runs in backward and travels backward too), prefetched. Making room evicts the least recently used layer other
than the one in use. A layer still in the buffer is not copied again, so a step copies fewer bytes than "every
forward and every backward fetches every layer": ``copies_per_step`` counts them for a stage's program.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BUFFER_LAYERS = 2  # the layer in use and the prefetched next


class LayerBuffer:
    """The resident set of a stage's streamed layers (least recently used first) and what each use copies."""

    def __init__(self, layers: Sequence[int], capacity: int = BUFFER_LAYERS) -> None:
        self.order = sorted(layers)
        self.capacity = capacity
        self.resident: list[int] = []

    def use(self, layer: int, backward: bool) -> tuple[list[int], list[int]]:
        """``layer`` is about to compute (in a backward pass or not): the layers to copy now, in order (it first
        if absent, then the prefetched next), and the layers evicted before them."""
        copied: list[int] = []
        evicted: list[int] = []
        self._bring(layer, None, copied, evicted)
        self.resident.remove(layer)
        self.resident.append(layer)
        at = self.order.index(layer) + (-1 if backward else 1)
        if 0 <= at < len(self.order):
            self._bring(self.order[at], layer, copied, evicted)
        return copied, evicted

    def _bring(self, layer: int, keep: int | None, copied: list[int], evicted: list[int]) -> None:
        if layer in self.resident:
            return
        while len(self.resident) >= self.capacity:
            victim = next(i for i in self.resident if i != keep)
            self.resident.remove(victim)
            evicted.append(victim)
        self.resident.append(layer)
        copied.append(layer)


def copies_per_step(ops: Iterable[str], layers: Sequence[int]) -> dict[int, int]:
    """How many times each streamed layer is copied host-to-device in every step after the first of a stage whose
    program runs ``ops`` (action types: "F", "B", ...; one forward or backward of every layer each). Recomputation
    adds no copy: the re-run forward finds its layer resident."""
    ops = list(ops)
    buffer = LayerBuffer(layers)
    counts: dict[int, int] = {}
    for _ in range(2):  # the first step starts from an empty buffer; every later one from where a step ends
        counts = dict.fromkeys(buffer.order, 0)
        for op in ops:
            if op not in ("F", "B"):
                continue
            travel = reversed(buffer.order) if op == "B" else buffer.order
            for layer in list(travel):
                for copied in buffer.use(layer, op == "B")[0]:
                    counts[copied] += 1
    return counts
