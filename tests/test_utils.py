"""Tier a: the package's small helpers: dotted paths (both spellings, and each way one can fail,
named with its field), the integer field check and sizes in messages."""

import dataclasses
import os.path

import pytest

from stapo_megatron.utils import (check_at_least, format_bytes, free_port, is_dotted_path, load_dotted, local_rank_env,
                                  lookup_registered)


def test_dotted_path_form():
    assert is_dotted_path("pkg.module:name") and is_dotted_path("pkg.module.name")
    assert not is_dotted_path("stapo") and not is_dotted_path(None) and not is_dotted_path(3)


def test_both_spellings_load_the_same_object():
    assert load_dotted("os.path:join", "f") is os.path.join
    assert load_dotted("os.path.join", "f") is os.path.join


@pytest.mark.parametrize("path, message", [
    ("join", "f = 'join' is not a dotted path 'package.module:name' or 'package.module.name'"),
    ("os:path.join", "f = 'os:path.join' is not a dotted path"),
    ("no_such_module_xyz:f", "f = 'no_such_module_xyz:f' does not name an importable object: cannot import module "
                             "'no_such_module_xyz'"),
    ("os.path:no_such_name", "f = 'os.path:no_such_name' does not name an importable object: module 'os.path' has "
                             "no attribute 'no_such_name'"),
])
def test_bad_paths_name_the_field_and_the_path(path, message):
    with pytest.raises(ValueError) as info:
        load_dotted(path, "f")
    assert str(info.value).startswith(message)


def test_check_at_least_names_the_class_and_field():
    @dataclasses.dataclass
    class Sizes:
        workers: int = 1
        ranks: int = 2

    check_at_least(Sizes(), 1, "workers", "ranks")
    check_at_least(Sizes(), 2, "ranks")
    with pytest.raises(ValueError, match=r"^Sizes.ranks must be >= 3, got 2$"):
        check_at_least(Sizes(), 3, "ranks")
    with pytest.raises(ValueError, match=r"^Sizes.workers must be >= 1, got 0$"):
        check_at_least(Sizes(workers=0), 1, "workers", "ranks")


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (64 * 1024, "64.0 KiB"),
    (1_234_567, "1.18 MiB"), (768 * 2**20, "768 MiB"), (12 * 2**30, "12.0 GiB"), (3 * 2**40, "3.00 TiB"),
    (1 << 62, "4.00 EiB"), (1 << 70, "1024 EiB"), (2.5 * 2**30, "2.50 GiB")])
def test_format_bytes_picks_the_unit_by_magnitude(nbytes, text):
    assert format_bytes(nbytes) == text


def test_lookup_registered_takes_a_name_a_dotted_path_or_names_the_closest():
    table = {"stapo": "S", "justrl": "J"}
    assert lookup_registered("stapo", table, "loss.method", lambda obj, path: (obj, path)) == "S"
    assert lookup_registered("os.path:join", table, "loss.method", lambda obj, path: (obj, path)) == (
        os.path.join, "os.path:join")
    with pytest.raises(ValueError, match=r"method must be one of \('stapo', 'justrl'\), got 'stap' "
                                         r"\(did you mean 'stapo'\?\) \(a user method"):
        lookup_registered("stap", table, "loss.method", lambda obj, path: obj)
    with pytest.raises(ValueError, match="loss.objective = 'no_such_pkg.mod:fn' does not name an importable object"):
        lookup_registered("no_such_pkg.mod:fn", table, "loss.objective", lambda obj, path: obj)


def test_local_rank_env_is_torchruns():
    port = free_port()
    assert 0 < port < 65536
    assert local_rank_env(1, 2, port) == dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", LOCAL_RANK="1",
                                              WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
