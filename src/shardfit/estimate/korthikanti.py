"""The paper's activation formulas: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198), sec. 4 and Table 2. 16-bit activations, 1-byte dropout
masks, a GPT layer (LayerNorm, MHA, 4h GeLU MLP, dropout after attention and MLP).

Per layer (bytes), s = sequence, b = micro-batch, h = hidden, a = heads, t = tensor-parallel size:
  attention 11sbh + 5as^2b: the QKV input 2sbh and the output dropout mask sbh stay replicated
  under TP; Q, K (4sbh), softmax (2as^2b), its dropout mask (as^2b) and output (2as^2b), V (2sbh)
  and the output projection's input (2sbh) are split over t.
  MLP 19sbh: the input 2sbh and the dropout mask sbh replicated; the GeLU input and output (8sbh
  each, 4h wide) split.   Two LayerNorm inputs: 4sbh replicated.
So (Table 2):
  no parallelism               sbh(34 + 5as/h)
  tensor parallel              sbh(10 + 24/t + 5as/(ht))
  tensor + sequence parallel   sbh(34/t + 5as/(ht))
  tensor + selective recompute sbh(10 + 24/t)
  tensor + sequence + selective sbh(34/t)
  full recompute               2sbh (only each layer's input; /t when it is sequence-parallel)
Whole model on the first pipeline stage (sec. 4.2.3): 1F1B keeps p micro-batches of L/p layers, so
L layers' worth; interleaved multiplies by 1 + (p-1)/(p*v). The embedding's dropout mask adds sbhp/t
(p micro-batches in flight); without pipelining, the output layer adds 4sbh/t * (1 + V/h).

`ffn` generalises the two 4h-wide MLP tensors to 4*ffn/h (Megatron's 18 + 4*ffn/h, which is 34 at
ffn = 4h). No torch.
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False,
                           recompute: str = "none", ffn: int | None = None) -> float:
    """One transformer layer's saved activations on one tensor-parallel rank, Table 2."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: use one of {RECOMPUTE}")
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    mlp_wide = 4 * (ffn if ffn else 4 * h) / h  # the GeLU input and output: 16 at ffn = 4h
    replicated, split = 10.0, 8.0 + mlp_wide
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * ((replicated + split) / t + scores / t)
    return s * b * h * (replicated + split / t + scores / t)


def in_flight_factor(p: int, v: int = 1, microbatches: int | None = None) -> float:
    """The first stage's activations as a multiple of one micro-batch through L/p layers ... times p:
    the factor on L layers' worth. 1F1B: min(1, m/p) when fewer micro-batches than stages;
    interleaved: 1 + (p-1)/(p*v)."""
    if p == 1:
        return 1.0
    if v > 1:
        return 1 + (p - 1) / (p * v)
    return min(1.0, microbatches / p) if microbatches else 1.0


def first_stage_activation_bytes(s: int, b: int, h: int, a: int, layers: int, vocab: int, t: int = 1,
                                 p: int = 1, v: int = 1, microbatches: int | None = None, *, sp: bool = False,
                                 recompute: str = "none", ffn: int | None = None) -> float:
    """The most loaded (first) pipeline rank's activations for a whole step, sec. 4.2.3: the layers,
    the embedding's dropout mask (p micro-batches), and the output layer when p = 1."""
    total = layer_activation_bytes(s, b, h, a, t, sp=sp, recompute=recompute, ffn=ffn) * layers
    total += s * b * h * p / t  # embedding dropout mask, p micro-batches in flight
    total *= in_flight_factor(p, v, microbatches)
    if p == 1:
        total += 4 * s * b * h / t * (1 + vocab / h)
    return total
