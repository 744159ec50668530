"""The emitted scripts run for real on 2 gloo ranks through tests/emit/run_emitted.py, which counts
their collectives (as `shardfit bench` does) and their host memory from outside: real text data with
a local tokenizer, no-sync accumulation, peak host RSS of the meta-device load. Each launch checks
several things, to keep the suite short."""
import json
import re
from importlib import resources
from pathlib import Path

import pytest

from launch import test_env as launch_env, torchrun
from run_emitted import micro_batch_counts
from shardfit.emit import EmitOptions, emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Schedule, Training, parse_strategy

pytestmark = pytest.mark.multirank
RUNNER = Path(__file__).with_name("run_emitted.py")
CORPUS = str(resources.files("shardfit.data").joinpath("corpus.txt"))
LOSS = re.compile(r"step (\d+) loss ([0-9.]+)")


def _plan(model, fmt, accum=4, seq=64, steps=6, **training):
    return Plan(model=load_model_spec(model), strategy=parse_strategy(fmt),
                training=Training(micro_batch=2, grad_accum=accum, seq_len=seq, precision="fp32", **training),
                cluster=Cluster(nodes=1, gpus_per_node=2, gpu="custom:1"),
                schedule=Schedule(steps=steps, log_every=1, lr=1e-2))


def _run(tmp_path, plan, fmt, options=None, **env):
    name, text = next(iter(emit(plan, fmt, options or EmitOptions()).files.items()))
    script = tmp_path / name
    script.write_text(text)
    env = {"SAVE_EVERY": "0", "EXPORT_DIR": "", **env}
    done = torchrun([str(RUNNER), str(script)], nproc=2, timeout=300, env=launch_env(**env), cwd=tmp_path)
    reports = {r["rank"]: r for r in (json.loads(line[7:]) for line in done.stdout.splitlines()
                                      if line.startswith("REPORT "))}
    assert set(reports) == {0, 1}, done.stdout[-3000:]
    losses = [float(loss) for _, loss in LOSS.findall(done.stdout)]
    return text, done.stdout, reports, losses


def _tokenizer(path):
    """A small BPE tokenizer trained here on the shipped corpus and saved as a local folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from shardfit.data import read_documents
    docs, _ = read_documents(None)
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_fsdp2_script_trains_on_text_and_reduce_scatters_once_per_step(tmp_path):
    tokenizer = _tokenizer(tmp_path / "tok")
    plan = _plan("tiny-llama", "fsdp2", accum=4, steps=5)
    text, stdout, reports, losses = _run(tmp_path, plan, "fsdp2", EmitOptions(data=CORPUS, tokenizer=tokenizer))
    assert f"'{CORPUS}'" in text and f"'{tokenizer}'" in text
    # Real text through a 300-token BPE: the loss starts near ln(320) and falls.
    assert len(losses) == 5 and all(0 < loss < 20 for loss in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    for report in reports.values():
        per_micro = micro_batch_counts(report["events"])
        assert len(per_micro) == 5 and all(len(step) == 4 for step in per_micro), per_micro
        # No-sync accumulation: micro-batches 1-3 reduce nothing, the last one every FSDP unit once
        # (tiny-llama: embedding, 4 blocks, head, root = 7 units).
        assert all(step[:3] == [0, 0, 0] and step[3] == 7 for step in per_micro), per_micro
