"""The train log's memory figures on CPU: the tensor peak from the memory budget's accounting,
and the process RSS apart, labelled (it holds the interpreter and libraries, not just tensors)."""
import torch

import shardfit
from shardfit.train.loop import _log_line, peak_memory_bytes

RECORD = {"step": 3, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}


def test_cpu_tensor_peak_comes_from_the_budget_accounting_not_rss():
    with shardfit.profile(budget_bytes=2**30, explain_oom=False):
        block = torch.ones(2**20, dtype=torch.float32)  # 4 MiB, the largest tensor of this run
        del block
        tensors, rss = peak_memory_bytes(torch.device("cpu"))
    assert 4 * 2**20 <= tensors < 5 * 2**20
    assert rss > 20 * tensors  # the interpreter and torch: what the old `peak` printed
    line = _log_line(dict(RECORD, peak_mem_bytes=tensors, rss_bytes=rss), 10)
    assert "| peak tensors 4.00 MiB | rss " in line
    assert line.endswith("MiB") or line.endswith("GiB")


def test_without_a_budget_a_cpu_run_logs_only_the_labelled_rss():
    tensors, rss = peak_memory_bytes(torch.device("cpu"))
    assert tensors is None and rss > 0
    line = _log_line(dict(RECORD, rss_bytes=rss), 10)
    assert "peak" not in line and "| rss " in line



def test_a_live_bar_only_on_a_terminal(monkeypatch):
    import io
    import sys

    from shardfit.train.loop import stdout_is_terminal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a log file, a pipe: no bar
    assert not stdout_is_terminal()
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert stdout_is_terminal()
