"""A bitsandbytes base through a DCP checkpoint (engines/quantized_state.py), in one process: the packed
weights, Linear4bit's QuantState and Linear8bitLt's SCB come back exactly, into the live tensors."""
from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.four = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.float32, compress_statistics=True,
                                      quant_type="nf4")
        self.eight = bnb.nn.Linear8bitLt(128, 32, bias=True, has_fp16_weights=False, threshold=6.0)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.eight(self.four(x)))


def _quantized_base(seed: int) -> Base:
    torch.manual_seed(seed)
    model = Base()
    for layer in (model.four, model.eight):  # random weights per seed, quantized on .to() as from_pretrained does
        layer.weight.data = torch.randn_like(layer.weight.data.float()).to(layer.weight.dtype)
    return model.to("cpu")


def _snapshot(model: Base) -> dict:
    quant = model.four.weight.quant_state
    return {"four.weight": model.four.weight.data.clone(), "absmax": quant.absmax.clone(),
            "offset": quant.offset.clone(), "nested_absmax": quant.state2.absmax.clone(),
            "eight.weight": model.eight.weight.data.clone(), "SCB": model.eight.weight.SCB.clone(),
            "norm": model.norm.weight.detach().clone()}


def test_dcp_round_trip_restores_the_quantized_base(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardfit.engines import quantized_state
    from shardfit.engines.dcp_io import SafeMetadataReader

    source = _quantized_base(1)
    with torch.no_grad():
        source.norm.weight.fill_(0.5)
    state = quantized_state.model_state_dict(source)
    assert {"four.weight.absmax", "four.weight.nested_absmax", "four.weight.quant_state.bitsandbytes__nf4",
            "eight.SCB", "eight.weight_format"} <= set(state)
    dcp.save({"model": state}, checkpoint_id=str(tmp_path))

    target = _quantized_base(2)  # other weights, so other absmax / SCB / offset
    before, expected = _snapshot(target), _snapshot(source)
    assert not before["absmax"].equal(expected["absmax"]) and not before["SCB"].equal(expected["SCB"])
    live = target.four.weight.quant_state.absmax
    reader = SafeMetadataReader(str(tmp_path))
    loaded = {"model": quantized_state.load_targets(target, tmp_path, reader)}
    dcp.load(loaded, storage_reader=reader)
    quantized_state.load_model_state_dict(target, loaded["model"])
    after = _snapshot(target)
    assert all(after[key].equal(expected[key]) for key in expected), [k for k in expected if not after[k].equal(expected[k])]
    assert target.four.weight.quant_state.absmax is live  # copied in place
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert target(x).equal(source(x))


def test_checkpoint_without_the_quant_state_is_one_clear_error(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardfit.engines import quantized_state
    from shardfit.engines.dcp_io import SafeMetadataReader
    from shardfit.errors import ShardfitError

    plain = {k: v for k, v in quantized_state.model_state_dict(_quantized_base(1)).items() if ".weight." not in k}
    dcp.save({"model": plain}, checkpoint_id=str(tmp_path))
    with pytest.raises(ShardfitError, match="has no 'four.weight.absmax'.*resume with the plan that wrote it"):
        quantized_state.load_targets(_quantized_base(2), tmp_path, SafeMetadataReader(str(tmp_path)))
