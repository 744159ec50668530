"""Sizes with units, through the one parser every size flag uses (spec/sizes.py)."""
import pytest
from hypothesis import given, strategies as st

from shardfit.errors import ShardfitError
from shardfit.spec.gpus import get_gpu
from shardfit.spec.sizes import BYTE_UNITS, COUNT_UNITS, parse_gib, parse_size

UNIT_SPELLINGS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(UNIT_SPELLINGS)),
       st.sampled_from(["", " "]), st.sampled_from([str.lower, str.upper, lambda s: s]))
def test_integer_with_any_unit_spelling(number, unit, space, case):
    assert parse_size(f"{number}{space}{case(unit)}") == number * UNIT_SPELLINGS[unit]


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(sorted(UNIT_SPELLINGS)))
def test_decimal_and_exponent_forms_agree(value, unit):
    scale = UNIT_SPELLINGS[unit]
    assert parse_size(f"{value!r}{unit}") == round(value * scale)
    assert parse_size(f"{value:e}{unit}") == round(float(f"{value:e}") * scale)


@given(st.integers(min_value=0, max_value=10**9), st.sampled_from(["B", "GiB", "elements"]))
def test_plain_number_keeps_the_flags_unit(number, plain):
    assert parse_size(str(number), plain) == number * {"B": 1, "GiB": 2**30, "elements": 1}[plain]


@given(st.integers(min_value=1, max_value=10**4), st.sampled_from(["", "K", "M", "G", "k", "m"]))
def test_element_counts_take_count_suffixes_only(number, suffix):
    assert parse_size(f"{number}{suffix}", "elements") == number * COUNT_UNITS[suffix.lower()]


@pytest.mark.parametrize("unit", ["MiB", "GB", "KB"])
def test_element_counts_refuse_byte_units(unit):
    with pytest.raises(ShardfitError, match="number of elements"):
        parse_size(f"5{unit}", "elements", "--bucket")


@given(st.text(alphabet="abcxyz%$-_!", min_size=1, max_size=6))
def test_garbage_is_one_clear_error(word):
    with pytest.raises(ShardfitError, match="--memory-budget"):
        parse_size(word, "B", "--memory-budget")


@pytest.mark.parametrize("text", ["3PB", "3 mebibytes", "nan", "inf", "1e400", "1e400GiB", "-3MiB", "3MiB4"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ShardfitError):
        parse_size(text, "B", "--memory-budget")


def test_units_are_the_documented_powers():
    assert BYTE_UNITS["mib"] == 2**20 and BYTE_UNITS["mb"] == 10**6
    assert parse_size("3MiB") == 3 * 2**20 and parse_size("2.5GB") == 2_500_000_000


@given(st.floats(min_value=0.001, max_value=1000, allow_nan=False))
def test_custom_gpu_sizes_through_the_same_parser(gib):
    assert get_gpu(f"custom:{gib!r}").memory_gib == gib  # plain: GiB, as before
    assert get_gpu(f"custom:{gib!r}GiB").memory_gib == gib
    assert get_gpu(f"custom:{gib!r}GB").memory_gib == pytest.approx(gib * 1e9 / 2**30)
    assert parse_gib(f"{gib!r}") == gib


def test_cli_flags_take_units(tmp_path):
    from shardfit.cli import build_parser

    train = build_parser(only="train").parse_args(["train", "--memory-budget", "3MiB"])
    assert train.memory_budget == 3 * 2**20
    assert build_parser(only="train").parse_args(["train", "--memory-budget", "5000000"]).memory_budget == 5_000_000
    profile = build_parser(only="profile").parse_args(["profile", "--budget", "2.5 MB", "--bucket", "500M"])
    assert (profile.budget, profile.bucket) == (2_500_000, 500_000_000)
    export = build_parser(only="export").parse_args(["export", "x", "--out", "y", "--max-shard-gb", "512MiB"])
    assert export.max_shard_gb == 0.5
    from shardfit.bench.run import parse_budgets

    assert parse_budgets("ddp=3MiB,zero3=2e6", ["ddp", "zero3"]) == {"ddp": 3 * 2**20, "zero3": 2_000_000}


def test_cli_refuses_a_bad_size_in_one_line(capsys):
    from shardfit.cli import main

    assert main(["train", "--memory-budget", "3 parsecs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-budget" in err[0] and "unit" in err[0]


def test_help_names_the_unit(capsys):
    from shardfit.cli import build_parser

    for command, flag in (("train", "--memory-budget"), ("profile", "--bucket"), ("bench", "--memory-budget")):
        text = build_parser(only=command)._subparsers._group_actions[0].choices[command].format_help()
        line = " ".join(text.split())
        assert flag in line and ("plain bytes" in line or "elements" in line)
