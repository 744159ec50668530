"""The engine matrix's gap table: where the estimator still misses a real 2-rank step (strict both
ways). Until 2026-12-06 a second table excused terms whose measured value moved between runs; that was
gloo's worker thread deciding when some buffers died (measure/collective_release.py, calibration §16),
and every such term now measures the same run after run (three runs): each is a pass or a gap here."""
from __future__ import annotations


# The (configuration, "phase/category") pairs the estimator still misses, each with the mechanism
# (docs/estimator-calibration.md). Strict both ways: a term off and not listed fails, and so does a
# listed term that now meets the tolerance (remove it from here). Model states (params, grads at
# rest, optimizer) and every peak are within tolerance everywhere; what is left is how activations,
# grads and temporaries divide at the instant of the backward peak, optimizer-step scratch and LoRA.
_BACKWARD = ("backward peak split: the estimator composes activations / grads / temporaries at one of four "
             "assumed instants; the real peak falls between them -- inside a block's backward, part way through "
             "its recompute or its MLP, or (ZeRO-3) while a bucket's reduce-scatter holds two flat copies of it "
             "(calibration §5)")
_FSDP_BACKWARD = ("FSDP backward peak split: the unsharded grad of a unit, the next unit's prefetch and the root's "
                  "unsharded grads are never all live at the peak (the reduce-scatter is synchronous on CPU); "
                  "without checkpointing the real peak is at backward's start, a near-tie with the instant the "
                  "estimator picks (calibration §5, §6)")
_STEP = ("optimizer-step scratch: single-tensor AdamW / CPU-Adam copies, and DeepSpeed's ipg bucket still "
         "allocated on one rank only during the step (calibration §4)")
_LORA = ("LoRA + checkpointing: peft makes the embedding output require grad, so one b*s*h fp32 tensor of the "
         "last forward outlives the step with ~34 KiB of other temporaries, and the adapter path adds tensors "
         "the block model doesn't list; the step scratch is sized by the largest frozen layer, not the largest "
         "adapter (calibration §7)")
_ZERO12_LORA = ("ZeRO-1/2 LoRA: the frozen head takes no weight gradient, so the ipg buckets appear only when the "
                "last block's adapters reach their hook, part way through that block's backward with the loss's "
                "buffers freed; the estimator's backward instants put them at backward's start (calibration §7)")
_LORA_FORWARD = ("LoRA forward peak: one more b*s*h fp32 tensor is alive at the loss than the block model lists "
                 "(32,768 B here, the adapter path of the last block), and under FSDP2 the prefetched unit's "
                 "adapters are gathered next to its frozen weights (+14,336 B); with the head a unit of its own "
                 "(fsdp2's default, spec/fsdp_units.py) that peak is inside the last block, not at the loss, so "
                 "the activations there are fewer and the temporaries more (calibration §7)")
_ZERO3_LORA_STEP = ("ZeRO-3 LoRA step: its persistent parameters (small tensors ZeRO-3 never partitions) and the "
                    "frozen base stay gathered through step() (params x3 measured), and no fp32 sub-group gradient "
                    "appears beside the 16-bit partition (calibration §4, §7)")
KNOWN_GAPS: dict[str, dict[str, str]] = {
    "tiny-llama/fsdp:full_shard/fp32/lora-ac-none": {"forward/temporaries": _LORA_FORWARD},
    "tiny-llama/fsdp2/fp32/lora-ac-none": {"forward/activations": _LORA_FORWARD,
                                           "forward/temporaries": _LORA_FORWARD},
    "tiny-llama/zero2/fp32/lora-ac-none": {
        "forward/temporaries": _ZERO12_LORA, "backward/activations": _ZERO12_LORA,
        "backward/temporaries": _ZERO12_LORA, "peak/*": _ZERO12_LORA},
    "tiny-llama/zero2/bf16/lora-ac-none": {
        "forward/temporaries": _ZERO12_LORA, "backward/activations": _ZERO12_LORA,
        "backward/temporaries": _ZERO12_LORA},
    "tiny-llama/zero1/fp32/ac-full": {"backward/activations": _BACKWARD},
    "tiny-llama/zero1/bf16/ac-full": {"backward/activations": _BACKWARD},
    "tiny-llama/zero2/fp32/ac-full": {"backward/activations": _BACKWARD},
    "tiny-llama/zero2/bf16/ac-full": {"backward/activations": _BACKWARD},
    "tiny-llama/zero3/fp32/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-llama/zero3/bf16/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-llama/zero2+offload/fp32/ac-full": {"backward/activations": _BACKWARD},
    "tiny-llama/zero2+offload/bf16/ac-none": {"optimizer/temporaries": _STEP},
    "tiny-llama/zero2+offload/bf16/ac-full": {"backward/activations": _BACKWARD, "optimizer/temporaries": _STEP},
    "tiny-llama/zero3+offload/fp32/ac-full": {"backward/grads": _BACKWARD, "backward/activations": _BACKWARD,
                                              "backward/temporaries": _BACKWARD},
    "tiny-llama/zero3+offload/bf16/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-gpt2/zero1/bf16/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-gpt2/zero3/bf16/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-gpt2/zero3+offload/bf16/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-llama/ddp/fp32/ac-full": {"backward/grads": _BACKWARD, "backward/activations": _BACKWARD},
    "tiny-llama/ddp/bf16/ac-full": {
        "backward/grads": _BACKWARD, "backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-llama/fsdp:full_shard/fp32/ac-none": {
        "backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp:full_shard/fp32/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp:full_shard/bf16/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp:shard_grad_op/fp32/ac-full": {"backward/activations": _FSDP_BACKWARD},
    "tiny-llama/fsdp:shard_grad_op/bf16/ac-full": {
        "backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},

    "tiny-llama/fsdp2/fp32/ac-full": {"backward/grads": _FSDP_BACKWARD, "backward/activations": _FSDP_BACKWARD,
                                      "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp2/bf16/ac-full": {"backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-gpt2/ddp/bf16/ac-full": {
        "backward/grads": _BACKWARD, "backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-gpt2/fsdp:full_shard/fp32/ac-none": {"backward/temporaries": _FSDP_BACKWARD},
    "tiny-gpt2/fsdp:shard_grad_op/bf16/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/activations": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/zero3/fp32/lora-ac-none": dict.fromkeys(
        ("optimizer/params", "optimizer/grads", "optimizer/temporaries"), _ZERO3_LORA_STEP),
    "tiny-llama/zero3/bf16/lora-ac-none": dict.fromkeys(
        ("optimizer/params", "optimizer/grads", "optimizer/temporaries"), _ZERO3_LORA_STEP),
    "tiny-gpt2/fsdp2/fp32/ac-none": {"backward/temporaries": _FSDP_BACKWARD, "optimizer/temporaries": _STEP},
    "tiny-llama/ddp/fp32/lora-ac-full": {
        "load/activations": _LORA, "load/temporaries": _LORA, "forward/activations": _LORA,
        "forward/temporaries": _LORA, "backward/activations": _LORA,
        "optimizer/activations": _LORA, "optimizer/temporaries": _LORA},
    "tiny-llama/fsdp2/fp32/lora-ac-full": {
        "load/activations": _LORA, "load/temporaries": _LORA, "forward/activations": _LORA,
        "forward/temporaries": _LORA, "backward/grads": _LORA, "backward/activations": _LORA,
        "backward/temporaries": _LORA, "optimizer/activations": _LORA, "optimizer/temporaries": _LORA},
}


# Terms whose measured value moved between identical runs: none since 2026-12-06 (module docstring).
# Kept as the place to list one, with the values seen, should a new engine bring a real race.
VARIES: dict[str, dict[str, str]] = {}


def varying_terms(label: str) -> dict[str, str]:
    return dict(VARIES.get(label, {}))
