"""Source rules: scan a training script's syntax tree (never run it) for the classic mistakes."""
from __future__ import annotations

import ast

from shardfit.doctor.rules import Finding
from shardfit.errors import ShardfitError

_OPTIMIZERS = {"Adam", "AdamW", "SGD", "Adafactor", "Lion", "RMSprop", "Adagrad", "AdamW8bit", "DeepSpeedCPUAdam",
               "FusedAdam"}
_SHARD_CALLS = {"fully_shard", "FSDP", "FullyShardedDataParallel"}
_GLOBAL_RNG_OWNERS = {"torch", "random", "np", "numpy", "cuda", "transformers", "set_seed"}
_RANDOM_USES = {"rand", "randn", "randint", "randperm", "random", "shuffle", "choice", "uniform", "normal", "dropout",
                "RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop", "RandAugment", "bernoulli", "multinomial"}


def _name(node) -> str:
    """Last component of a call target: `torch.optim.AdamW` -> AdamW."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif isinstance(node, ast.Call):
        parts.append(_name(node) + "()")
    return ".".join(reversed(parts))


def _mentions_rank(node) -> bool:
    for sub in ast.walk(node):
        text = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else (
            sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else "")
        if "rank" in str(text).lower():
            return True
    return False


def _scopes(tree):
    """The module and every function: statements are ordered within a scope."""
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _calls_in(scope):
    """Calls directly in this scope (not inside nested functions)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _loops_calls(tree):
    """(call, inside_loop) for every call."""
    def visit(node, in_loop):
        for child in ast.iter_child_nodes(node):
            looping = in_loop or isinstance(node, (ast.For, ast.While, ast.AsyncFor))
            if isinstance(child, ast.Call):
                yield child, looping
            yield from visit(child, looping)
    yield from visit(tree, False)


def optimizer_before_shard(tree, path) -> list[Finding]:
    out = []
    for scope in _scopes(tree):
        calls = list(_calls_in(scope))
        shards = [c.lineno for c in calls if _name(c) in _SHARD_CALLS]
        optims = [c for c in calls if _name(c) in _OPTIMIZERS]
        if shards and optims and min(o.lineno for o in optims) < min(shards):
            line = min(o.lineno for o in optims)
            out.append(Finding(rule="optimizer-before-shard", severity="error",
                               message=f"the optimizer is built (line {line}) before the model is sharded (line "
                                       f"{min(shards)}): it holds the unsharded parameters, which sharding replaces, so "
                                       "it updates tensors the model no longer uses (or keeps the full copies alive)",
                               fix="build the optimizer after fully_shard / FSDP(...) from model.parameters()",
                               where=f"{path}:{line}"))
    return out


def fsdp_without_auto_wrap_source(tree, path) -> list[Finding]:
    out = []
    fully = []
    for call, in_loop in _loops_calls(tree):
        name = _name(call)
        if name in ("FSDP", "FullyShardedDataParallel"):
            if not any(k.arg == "auto_wrap_policy" for k in call.keywords) and not any(k.arg is None for k in call.keywords):
                out.append(Finding(rule="fsdp-no-auto-wrap", severity="error",
                                   message="FSDP(...) without auto_wrap_policy wraps the whole model as one unit: the "
                                           "all-gather brings back every parameter at once",
                                   fix="pass auto_wrap_policy=ModuleWrapPolicy({YourBlockClass}) (or "
                                       "transformer_auto_wrap_policy)", where=f"{path}:{call.lineno}"))
        elif name == "fully_shard":
            fully.append((call, in_loop))
    if fully and not any(in_loop for _, in_loop in fully) and len(fully) == 1:
        call = fully[0][0]
        out.append(Finding(rule="fsdp-no-auto-wrap", severity="error",
                           message="fully_shard is applied once, to the root only: the whole model is one unit",
                           fix="call fully_shard on each block in a loop first, then on the root",
                           where=f"{path}:{call.lineno}"))
    return out


def empty_cache_in_loop(tree, path) -> list[Finding]:
    for call, in_loop in _loops_calls(tree):
        if in_loop and _name(call) == "empty_cache":
            return [Finding(rule="empty-cache-every-step", severity="warning",
                            message="torch.cuda.empty_cache() inside the training loop: it frees no memory the step "
                                    "needs and forces slow cudaMalloc calls on the next step",
                            fix="remove it; for fragmentation set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                            where=f"{path}:{call.lineno}")]
    return []


def rng_rules(tree, path) -> list[Finding]:
    out = []
    seeded = False
    uses_random = None
    for call, _ in _loops_calls(tree):
        name, target = _name(call), _dotted(call.func)
        owner = target.split(".")[0] if "." in target else target
        if name in ("manual_seed", "seed", "set_seed", "manual_seed_all"):
            global_rng = owner in _GLOBAL_RNG_OWNERS or target in ("set_seed", "seed_everything")
            if global_rng:
                seeded = True
                if any(_mentions_rank(arg) for arg in list(call.args) + [k.value for k in call.keywords]):
                    out.append(Finding(rule="rank-dependent-rng", severity="warning",
                                       message=f"{target}(...) seeds the global RNG with the rank: model init and "
                                               "dropout differ per rank, and replicas that should agree drift apart",
                                       fix="seed the global RNG identically on every rank; give per-rank data "
                                           "randomness its own torch.Generator (or DistributedSampler(seed=...))",
                                       where=f"{path}:{call.lineno}"))
        elif name == "seed_everything":
            seeded = True
        elif name in _RANDOM_USES and owner in ("torch", "random", "np", "numpy", "transforms", "T", "F") and uses_random is None:
            generator = any(k.arg == "generator" for k in call.keywords)
            if not generator:
                uses_random = call
    if uses_random is not None and not seeded:
        out.append(Finding(rule="unseeded-rng", severity="warning",
                           message=f"random draws ({_dotted(uses_random.func)}) with no seed anywhere: every rank "
                                   "draws different augmentations/initial weights and runs are not reproducible",
                           fix="seed torch, random and numpy once at start-up with the same seed on every rank",
                           where=f"{path}:{uses_random.lineno}"))
    return out


def use_cache_with_checkpointing(tree, path) -> list[Finding]:
    gc_call = None
    cache_off = cache_on = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node) in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
            gc_call = gc_call or node
        if isinstance(node, ast.keyword) and node.arg == "use_cache" and isinstance(node.value, ast.Constant):
            cache_off, cache_on = (node, cache_on) if node.value.value is False else (cache_off, node)
        if isinstance(node, ast.Assign) and any(_name(t) == "use_cache" for t in node.targets) and isinstance(node.value, ast.Constant):
            cache_off, cache_on = (node, cache_on) if node.value.value is False else (cache_off, node)
    if gc_call is not None and (cache_on is not None or cache_off is None):
        line = (cache_on or gc_call).lineno
        return [Finding(rule="use-cache-with-checkpointing", severity="error",
                        message="gradient checkpointing with use_cache left on: the KV cache is built in the forward "
                                "and again in the recompute (transformers warns, some versions fail), wasting memory",
                        fix="set model.config.use_cache = False before training", where=f"{path}:{line}")]
    return []


def set_device_global_rank(tree, path) -> list[Finding]:
    for call, _ in _loops_calls(tree):
        name = _name(call)
        if name in ("set_device", "to", "cuda") and call.args:
            arg = call.args[0]
            text = ast.unparse(arg)
            if ("get_rank()" in text or text in ("rank", "global_rank")) and "local" not in text.lower():
                return [Finding(rule="device-from-global-rank", severity="error",
                                message=f"{_dotted(call.func)}({text}) picks the GPU by global rank: on the second node "
                                        "rank 8 asks for cuda:8, which does not exist",
                                fix="use int(os.environ['LOCAL_RANK']) for the device index",
                                where=f"{path}:{call.lineno}")]
    return []


def fp16_without_scaler_source(tree, path) -> list[Finding]:
    text = ast.unparse(tree)
    if "GradScaler" in text:
        return []
    for call, _ in _loops_calls(tree):
        if _name(call) == "autocast":
            for kw in call.keywords:
                if kw.arg == "dtype" and ast.unparse(kw.value) in ("torch.float16", "torch.half"):
                    return [Finding(rule="fp16-no-loss-scaling", severity="error",
                                    message="autocast to float16 with no GradScaler: small gradients underflow to zero",
                                    fix="wrap backward/step with torch.amp.GradScaler, or autocast to torch.bfloat16",
                                    where=f"{path}:{call.lineno}")]
    return []


SOURCE_RULES = (optimizer_before_shard, fsdp_without_auto_wrap_source, empty_cache_in_loop, rng_rules,
                use_cache_with_checkpointing, set_device_global_rank, fp16_without_scaler_source)


def scan_source(text: str, path: str) -> list[Finding]:
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise ShardfitError(f"{path}:{exc.lineno}: not valid Python ({exc.msg}): doctor reads scripts without running them") from None
    findings = []
    for rule in SOURCE_RULES:
        findings += rule(tree, path)
    return findings
