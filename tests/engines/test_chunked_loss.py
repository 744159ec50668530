"""engines/chunked_loss.py on one process: the chunked linear + cross-entropy equals torch's
cross_entropy on the full logits (value and gradients), whatever the chunking, with a bias and ignored
labels; installed on real transformers models it gives the model's own loss; bad models are one line."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shardfit.engines.chunked_loss import (IGNORE_INDEX, chunked_head, chunked_linear_cross_entropy, install,
                                           model_loss)
from shardfit.errors import ShardfitError


def _inputs(rows=37, hidden=16, vocab=101, bias=True):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::5] = IGNORE_INDEX
    return h, w, b, labels


@pytest.mark.parametrize("chunks", [1, 3, 8, 37, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_cross_entropy_on_the_full_logits(chunks, bias):
    h, w, b, labels = _inputs(bias=bias)
    reference = F.cross_entropy(F.linear(h, w, b), labels, ignore_index=IGNORE_INDEX)
    expected = torch.autograd.grad(reference, [t for t in (h, w, b) if t is not None])
    loss = chunked_linear_cross_entropy(h, w, b, labels, chunks)
    got = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    h, w, b, labels = _inputs(rows=6, hidden=3, vocab=7)
    assert torch.autograd.gradcheck(lambda h, w, b: chunked_linear_cross_entropy(h, w, b, labels, 4), (h, w, b))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-mixtral"])
@pytest.mark.parametrize("autocast", [False, True])
def test_installed_on_a_model_it_gives_the_models_own_loss(name, autocast):
    from shardfit.modeling import build_model
    from shardfit.spec.models import load_model_spec

    spec = load_model_spec(name)
    standard = build_model(spec.source, device="cpu", dtype=None, seed=1)
    chunked = copy.deepcopy(standard)
    install(chunked, 3)
    ids = torch.randint(0, spec.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # padding, as shardfit.data collates it
    batch = {"input_ids": ids, "labels": labels}
    losses = []
    for model, head in ((standard, None), (chunked, chunked_head(chunked))):
        torch.manual_seed(5)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model_loss(model, batch, head)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6 if not autocast else 1e-3)
    for mine, theirs in zip(chunked.parameters(), standard.parameters()):
        scale = theirs.grad.abs().max().item() + 1e-12
        assert (mine.grad - theirs.grad).abs().max().item() / scale < (1e-5 if not autocast else 2e-2)
    with torch.no_grad():  # without labels (generation) the head returns its logits
        assert chunked(input_ids=ids).logits.shape == (2, 17, spec.vocab_size)


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-gemma2"])
def test_heads_it_does_not_reproduce_are_refused(name):
    from shardfit.modeling import build_model
    from shardfit.spec.models import load_model_spec

    model = build_model(load_model_spec(name).source, device="cpu", dtype=None, seed=1)
    with pytest.raises(ShardfitError, match="use loss standard"):
        install(model, 4)
