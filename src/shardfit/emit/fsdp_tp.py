"""The FSDP2 x TP script's tensor-parallel function, as template text (emit/fsdp.py joins it into the
FSDP2 script): the model's own transformers TP plan applied with torch's `parallelize_module`, its
hook-only styles through transformers' own layer classes, the head's logits vocab-sharded into
torch's loss_parallel or gathered, a tied head re-tied to the embedding."""

TP_CODE = '''    def tensor_parallel(model, tp_mesh):
        # The model's own transformers TP plan (config.base_model_tp_plan, merged with the head's entry into
        # model._tp_plan): q/k/v and gate/up colwise, o/down rowwise, the embedding vocab-sharded, the head
        # colwise. Attention reshapes with -1 heads, so each rank runs heads / TP.
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        # LOSS_PARALLEL: the head's logits stay sharded over the vocabulary (a DTensor) into torch's
        # loss_parallel cross-entropy (sync_gradients); otherwise every rank gathers the V-wide logits.
        def head():
            if LOSS_PARALLEL:
                return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            return ColwiseParallel(output_layouts=Replicate())

        styles = {{"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
                   "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
                   "colwise_gather_output": head}}
        plan = dict(getattr(model, "_tp_plan", None) or {{}})
        # Hooks on parameters kept whole (transformers' own layer classes): Qwen3's per-head q_norm /
        # k_norm see this rank's heads only, so their gradients are all-reduced over tp; MLA's kv_a_proj
        # output has a rotary part whose gradient is too.
        hooks = ("replicated_with_grad_allreduce", "mla_kv_a_proj")
        parallelize_module(model, tp_mesh, {{path: styles[style]() for path, style in plan.items() if style not in hooks}})
        if any(style in hooks for style in plan.values()):
            import fnmatch

            from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
            config = model.config.get_text_config()
            for name, module in model.named_modules():
                for path, style in plan.items():
                    if style in hooks and fnmatch.fnmatchcase(name, path) and name.count(".") == path.count("."):
                        ALL_PARALLEL_STYLES[style].install_forward(module, tp_mesh, config=config)
        # parallelize_module gives the embedding and the head new parameters each: a tied head takes the
        # embedding's back (both are vocab-sharded the same way).
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
        if TIED and outputs is not None and outputs.weight is not inputs.weight:
            outputs.weight = inputs.weight


'''
