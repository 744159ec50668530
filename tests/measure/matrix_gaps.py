"""The engine matrix's gap tables: where the estimator still misses a real 2-rank step (strict),
and where the measured value itself moves between runs (never required to miss)."""
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
    "tiny-llama/zero3+offload/fp32/ac-full": {"backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
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
        "backward/grads": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp:full_shard/bf16/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},

    "tiny-llama/fsdp2/fp32/ac-full": {"backward/grads": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
    "tiny-llama/fsdp2/bf16/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/activations": _FSDP_BACKWARD,
        "backward/temporaries": _FSDP_BACKWARD},
    "tiny-gpt2/ddp/bf16/ac-full": {
        "backward/grads": _BACKWARD, "backward/activations": _BACKWARD, "backward/temporaries": _BACKWARD},
    "tiny-gpt2/fsdp:full_shard/fp32/ac-none": {"backward/temporaries": _FSDP_BACKWARD},
    "tiny-gpt2/fsdp:shard_grad_op/bf16/ac-full": {
        "backward/grads": _FSDP_BACKWARD, "backward/temporaries": _FSDP_BACKWARD},
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


# Terms whose measured value moves between identical runs (seen across seven runs of this matrix):
# whether one more grad tensor, or DeepSpeed's ipg bucket, is still alive on the worst rank at its
# peak instant depends on timing (ranks racing through backward and into the step), and the estimate
# lies at or between the values seen. Neither asserted as a pass nor as a gap.
_TIMING = "measured value moves between runs: {} (the peak instant depends on timing; calibration §10)"
VARIES: dict[str, dict[str, str]] = {
    "tiny-llama/zero3+offload/fp32/ac-full": {"backward/grads": _TIMING.format("0 or 45056, predicted 0")},
    "tiny-llama/zero3+offload/bf16/ac-full": {"backward/grads": _TIMING.format("0 or 22528, predicted 0")},
    # Seen once in a full suite with 3 pytest-xdist workers on 2 cores (2026-12-02): 329988 B, twice the
    # 163840 predicted, and within 5% in the runs before and after (the worst rank still holding one more
    # step buffer when it steps).
    "tiny-llama/fsdp:full_shard/bf16/ac-full": {"optimizer/temporaries": _TIMING.format("within 5% or 329988, predicted 163840")},
    # Whether the next unit's all-gather (prefetch, 197 KiB of frozen fp32 weights) is already out at the
    # worst rank's backward peak: 703896 B in four runs alone, 902920 once in a full suite (2026-12-05).
    "tiny-llama/fsdp2/fp32/lora-ac-none": {"backward/temporaries": _TIMING.format("703896 or 902920, predicted 705792")},
    # The same without LoRA, seen once in a full suite (2026-12-05, 3 workers on 2 cores): 884232 B; alone
    # within 5% of the 832000 predicted.
    "tiny-llama/fsdp2/fp32/ac-none": {"backward/temporaries": _TIMING.format("within 5% or 884232, predicted 832000")},
    # The same on tiny-gpt2 in fp32, seen once in a full suite (2026-12-04): 428036 B, twice the 213512 predicted.
    "tiny-gpt2/fsdp:full_shard/fp32/ac-none": {"optimizer/temporaries": _TIMING.format("within 5% or 428036, predicted 213512")},
    # And on tiny-llama under SHARD_GRAD_OP, seen once in a full suite (2026-12-05): 350724 B, twice the 163840.
    "tiny-llama/fsdp:shard_grad_op/fp32/ac-none": {"optimizer/temporaries": _TIMING.format("within 5% or 350724, predicted 163840")},
}

# DeepSpeed offload: whether the ipg bucket (reduce_bucket_size elements) is still allocated on the worst
# rank while CPU Adam steps is a race between the ranks; seen on four of the offload configurations
# (e.g. tiny-llama zero2+offload fp32: 84156 or 484136 B, predicted 81920; tiny-gpt2 zero2+offload
# fp32: 133388 or 533308, predicted 131072), so it holds for all of them.
VARIES_OFFLOAD_STEP = _TIMING.format("the ipg bucket alive on the worst rank during the step or not")
# FSDP1 with checkpointing: its backward peak lands at different instants of the recompute from run to
# run (tiny-llama shard_grad_op bf16: activations 300044, 407052 or 417292 B, predicted 429056; fp32:
# 744972 or 777740, predicted 789504; tiny-gpt2 shard_grad_op bf16: 902668 or 968204, predicted 951296;
# tiny-llama full_shard bf16: 384524, 417292 or 423436, predicted 379904).
VARIES_FSDP1_AC = _TIMING.format("where in the recompute FSDP1's backward peak lands")
# FSDP2 with checkpointing, the same (tiny-llama fp32: activations 634380 B in one full-suite run,
# within 5% of the 691200 predicted in others; grads/temporaries inside or outside 5% from run to run).
VARIES_FSDP2_AC = _TIMING.format("where in the recompute FSDP2's backward peak lands")
# DeepSpeed LoRA step: whether the ipg bucket and the adapters' gradient partitions are still alive on
# the worst rank when it steps (zero2 optimizer/temporaries 63764 B in one full-suite run, within 5% of
# the 57344 predicted in others; zero3 optimizer/grads 0 or 28672, temporaries 88220 or within 5%: its
# persistent parameters stay gathered through step() and no fp32 sub-group gradient may appear;
# calibration §4, §7).
VARIES_DEEPSPEED_LORA_STEP = _TIMING.format("which LoRA gradient buffers are alive on the worst rank at the step")


def varying_terms(label: str) -> dict[str, str]:
    terms = dict(VARIES.get(label, {}))
    strategy = label.split("/")[1]
    if "+offload" in strategy:
        terms.setdefault("optimizer/temporaries", VARIES_OFFLOAD_STEP)
    if strategy.startswith("fsdp:") and label.endswith("ac-full"):
        # ...and whether a unit's sharded gradient already exists there (tiny-llama shard_grad_op bf16:
        # backward/grads within 5% in one run, off in the next, 2026-12-05).
        for term in ("backward/activations", "backward/grads", "backward/temporaries"):
            terms.setdefault(term, VARIES_FSDP1_AC)
    if strategy == "fsdp2" and label.endswith("ac-full"):
        for term in ("backward/activations", "backward/grads", "backward/temporaries"):
            terms.setdefault(term, VARIES_FSDP2_AC)
    if strategy in ("zero2", "zero3") and "/lora-" in label:
        for term in ("optimizer/params", "optimizer/grads", "optimizer/temporaries"):
            terms.setdefault(term, VARIES_DEEPSPEED_LORA_STEP)
    return terms
