"""Greedy generation through whatever `model` is (an engine's wrapped model or a plain HF model).
No KV cache (training models are built with use_cache=False): the prompt is re-run every token,
which is fine for the few tokens of an eval sample."""
from __future__ import annotations

import torch


def greedy(model, prompt_ids: list[int], new_tokens: int, device, eos_id: int | None = None) -> list[int]:
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(input_ids=ids).logits
        token = int(logits[0, -1].float().argmax())
        out.append(token)
        # NOTE: every rank runs the same number of forwards even after EOS: sharded engines
        # all-gather inside forward, so an early exit on one rank would hang the others.
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    if eos_id is not None and eos_id in out:
        out = out[:out.index(eos_id)]
    return out


def engine_generate(engine, tokenizer, prompt: str, new_tokens: int = 24) -> tuple[list[int], str]:
    prompt_ids = tokenizer.encode(prompt)[:-1]  # drop EOS: continue the text
    with engine.inference() as model:
        tokens = greedy(model, prompt_ids, new_tokens, engine.ctx.device, tokenizer.eos_id)
    return tokens, tokenizer.decode(tokens)
