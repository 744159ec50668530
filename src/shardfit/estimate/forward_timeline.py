"""The forward's live bytes op by op inside each block, traced, for the forward-peak split.

The memory tracker files a tensor created in forward as an activation when backward still finds it
alive, and as a temporary otherwise. Inside a block the peak can be where neither the shapes nor the
saved tensors say: Bloom's composite gelu holds four b·s·I fp32 intermediates while the block's later
saved tensors and the head's do not exist yet; tensors a model builds once before its blocks and
never saves (Bloom's ALiBi bias, OPT's and Bloom's 4-D causal masks) stay alive through every block
as temporaries and are gone before the head runs. So the trace keeps, per storage, the op at which it
was created and the op at which its last tensor died, and afterwards splits each instant of a block
into the bytes of that block's saved tensors created so far (activations: autograd keeps them) and
every other live forward tensor (temporaries), parameters and autocast's weight casts aside (those
are counted as params and weight copies). The instants that peak at the traced points are fitted
like the saved bytes (estimate/derived.py's exact polynomials), and the estimator takes it at the
planned shape as one more "inside the last block" forward instant.
"""
from __future__ import annotations

import weakref

_NEVER = 1 << 62


class Timeline:
    """Per storage: bytes, the op index that created it, the op index after which it was freed
    (its last tensor died once that op had returned)."""

    def __init__(self, storage_key, skip: set):
        self.key, self.skip = storage_key, skip
        self.t = 0
        self.records: dict = {}  # storage key -> [nbytes, created, freed, live tensor objects]
        self.done: list = []
        self.blocks: dict = {}  # part -> [first op, last op]
        self.labels: dict = {}  # part -> ["aten op#n" per op]: the same instant at every shape
        self._seen: dict = {}  # part -> {op: times run}

    def op(self, part, outputs, name: str = "") -> None:
        """After op `name` ran in `part` ("pre", a block index, "post"): record its new output storages."""
        self.t += 1
        if isinstance(part, int):
            span = self.blocks.setdefault(part, [self.t, self.t])
            span[1] = self.t
            seen = self._seen.setdefault(part, {})
            seen[name] = seen.get(name, -1) + 1
            self.labels.setdefault(part, []).append(f"{name}#{seen[name]}")
        for tensor in outputs:
            key = self.key(tensor)
            if key in self.skip:
                continue
            record = self.records.get(key)
            if record is None:
                record = self.records[key] = [tensor.untyped_storage().nbytes(), self.t, _NEVER, 0]
            record[3] += 1
            weakref.finalize(tensor, self._release, key)

    def lifetime(self, tensor) -> tuple:
        """One id per storage lifetime (views share it; a later storage at a reused key does not)."""
        key = self.key(tensor)
        record = self.records.get(key)
        return (key, record[1] if record is not None else -1)

    def _release(self, key) -> None:
        record = self.records.get(key)
        if record is not None:
            record[3] -= 1
            if record[3] <= 0:
                record[2] = self.t
                self.done.append((key, record))
                del self.records[key]

    def block_instants(self, part: int, saved: dict, excluded: set) -> dict:
        """{op label: (this block's saved bytes alive, other live forward bytes)} after each op of block `part`.
        saved: {storage key: (part that saved it first, bytes)}; excluded: weight casts."""
        first, last = self.blocks[part]
        size = last - first + 1
        mine, other = [0] * (size + 1), [0] * (size + 1)
        # NOTE: saved tensors stay alive to the end of forward, so only a storage still alive can be
        # one of them: a freed storage's key may since belong to a saved one.
        for alive, (key, (nbytes, created, freed, _)) in [*((False, d) for d in self.done),
                                                          *((True, r) for r in self.records.items())]:
            if key in excluded or created > last or freed < first:
                continue
            owner = saved.get(key, (None,))[0] if alive else None
            if owner is not None and owner != part:
                continue  # saved by an earlier block or the embedding: counted in their activations
            series = mine if owner == part else other
            # A storage freed after op t still lived while t allocated its outputs: alive through t.
            lo, hi = max(created, first) - first, min(freed + 1, last + 1) - first
            series[lo] += nbytes
            series[hi] -= nbytes
        out, a, b = {}, 0, 0
        for i, label in zip(range(size), self.labels[part][-size:]):
            a, b = a + mine[i], b + other[i]
            out[label] = (a, b)
        return out


def peak_instants(series_by_point: dict, fit_points: list, check, solve, evaluate) -> list[dict]:
    """The instants of one block that peak (largest saved-so-far + live temporaries) at some traced
    point, each fitted as coefficients {"saved": ..., "temporaries": ...}. Instants are matched across
    shapes by op and occurrence ("aten.mul.Tensor#3"): op counts differ a little between shapes (views
    elided at b = 1). One whose fit misses the check point by more than 1% is left out."""
    points = list(series_by_point)
    common = set.intersection(*(set(series) for series in series_by_point.values()))
    chosen = sorted({max(common, key=lambda label, s=series: sum(s[label])) for series in series_by_point.values()}
                    if common else set())
    out = []
    for label in chosen:
        fitted = {name: solve({p: series_by_point[p][label][i] for p in fit_points})
                  for i, name in enumerate(("saved", "temporaries"))}
        actual = sum(series_by_point[check][label])
        if check in points and abs(sum(evaluate(c, *check) for c in fitted.values()) - actual) <= 0.01 * max(actual, 1):
            out.append(fitted)
    return out


def inside_instants(kinds: list, instants: list, evaluate, b: int, s: int) -> list[tuple[float, float]]:
    """(activations beyond the other blocks' and the embedding's, temporaries) at each traced peak
    instant of each block kind, when that kind's block is the last one: its saved bytes so far minus
    its whole block's, and the live temporaries."""
    out = []
    for kind, candidates in zip(kinds, instants):
        block = evaluate(kind, b, s)
        out += [(evaluate(c["saved"], b, s) - block, evaluate(c["temporaries"], b, s)) for c in candidates]
    return out
