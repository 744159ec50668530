"""What the worker reads off a running engine: the memory summary, and an exact fingerprint of
the rank-local model / optimizer / scheduler state for the checkpoint round trip."""
from __future__ import annotations

from shardfit.estimate.result import CATEGORIES


def summarize_memory(by_phase: dict[str, dict[str, int]]) -> dict:
    """Peak phase and its categories, device tensor bytes only (host bytes are offloaded state)."""
    by_phase = {phase: {cat: int(cats.get(cat, 0)) for cat in CATEGORIES} for phase, cats in by_phase.items()}
    totals = {phase: sum(cats.values()) for phase, cats in by_phase.items()}
    peak_phase = max(totals, key=totals.get)
    by_category = {cat: max(by_phase[p].get(cat, 0) for p in by_phase) for cat in CATEGORIES}
    return {"by_phase": by_phase, "peak_phase": peak_phase, "peak_bytes": totals[peak_phase],
            "by_category_at_peak": by_phase[peak_phase], "by_category_max": by_category}


# Above this many elements a tensor is kept as a digest of its bytes, not a copy: a 1B model's
# state would otherwise be written twice more next to its checkpoint.
_DIGEST_ABOVE = 1 << 20


def _local(tensor):
    """The rank-local part of a parameter or state tensor (DTensor shard, ZeRO-3 partition), as a
    CPU copy, or for big tensors (shape, dtype, blake2b of the bytes): equal iff bit-identical."""
    import hashlib

    import torch

    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    tensor = tensor.detach()
    if tensor.numel() <= _DIGEST_ABOVE:
        return tensor.to("cpu", copy=True)
    raw = tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return ("digest", tuple(tensor.shape), str(tensor.dtype), hashlib.blake2b(raw.data, digest_size=16).hexdigest())


def _walk(obj, prefix: str, out: dict) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = _local(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _walk(value, f"{prefix}.{key}", out)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _walk(value, f"{prefix}.{index}", out)
    elif isinstance(obj, (int, float, bool)):
        out[prefix] = obj


def fingerprint(engine, read_optimizer: bool = True) -> dict:
    """Rank-local model, optimizer and LR-scheduler state as {path: tensor or number}."""
    out: dict = {}
    for name, param in engine.model.named_parameters():
        out[f"model.{name}"] = _local(param)
    if read_optimizer and engine.optimizer is not None:
        _walk(engine.optimizer.state_dict(), "optim", out)
    if engine.scheduler is not None:
        _walk(engine.scheduler.state_dict(), "sched", out)
    return out


def compare(expected: dict, actual: dict, prefix: str) -> dict:
    """{"equal", "checked", "mismatched": first few paths, "max_abs_diff"} over paths starting with prefix."""
    import torch

    keys = sorted(k for k in expected if k.startswith(prefix))
    bad, worst = [], 0.0
    for key in keys:
        a, b = expected[key], actual.get(key)
        if isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            if isinstance(b, torch.Tensor) and a.shape == b.shape and a.numel():
                worst = max(worst, float((a.double() - b.double()).abs().max()))
        else:
            same = a == b
        if not same:
            bad.append(key)
    return {"equal": bool(keys) and not bad, "checked": len(keys), "mismatched": bad[:5], "max_abs_diff": worst}
