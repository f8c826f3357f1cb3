"""``write_secret`` and ``read_secret``: a key file is created only where nothing is, private
from its first byte, and read back only when it is still private, regular and whole."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.safety import read_secret, write_secret

SECRET = bytes(range(32))


@pytest.fixture
def no_umask() -> Iterator[None]:
    """Umask 0: the file's mode comes from write_secret alone."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_written_secret_reads_back(tmp_path: Path, no_umask: None) -> None:
    path = str(tmp_path / "k.key")
    write_secret(path, SECRET)
    assert read_secret(path, len(SECRET)) == SECRET
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["k.key"]  # no temporary left beside it


def test_an_existing_key_is_never_written_over(tmp_path: Path) -> None:
    path = str(tmp_path / "k.key")
    write_secret(path, SECRET)
    with pytest.raises(FileExistsError, match=r"k\.key exists already") as raised:
        write_secret(path, bytes(32))
    assert raised.value.filename == path
    assert read_secret(path, len(SECRET)) == SECRET
    assert os.listdir(tmp_path) == ["k.key"]


@pytest.mark.parametrize("target_exists", [False, True], ids=["dangling", "to-a-file"])
def test_a_link_at_the_path_is_not_followed(tmp_path: Path, target_exists: bool) -> None:
    target = tmp_path / "elsewhere"
    if target_exists:
        target.write_bytes(b"theirs")
    link = tmp_path / "k.key"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        write_secret(str(link), SECRET)
    assert target.exists() == target_exists
    if target_exists:
        assert target.read_bytes() == b"theirs"
    assert link.is_symlink()


def test_no_directory_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_secret(str(tmp_path / "missing" / "k.key"), SECRET)


def test_a_missing_key_propagates_so_the_caller_may_create_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_secret(str(tmp_path / "k.key"), 32)


def test_a_key_group_or_others_can_read_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "k.key")
    write_secret(path, SECRET)
    os.chmod(path, 0o640)
    problem = read_secret(path, len(SECRET))
    assert isinstance(problem, str) and "chmod 600" in problem


def test_a_key_of_another_size_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "k.key")
    write_secret(path, SECRET[:16])
    assert read_secret(path, 32) == f"{path} is not a 32-byte key"
    path2 = str(tmp_path / "long.key")
    write_secret(path2, SECRET + b"x")
    assert read_secret(path2, 32) == f"{path2} is not a 32-byte key"


def test_a_key_read_through_a_link_is_refused(tmp_path: Path) -> None:
    real = str(tmp_path / "real.key")
    write_secret(real, SECRET)
    link = tmp_path / "k.key"
    link.symlink_to(real)
    problem = read_secret(str(link), len(SECRET))
    assert isinstance(problem, str) and str(link) in problem


def test_a_directory_is_not_a_key(tmp_path: Path) -> None:
    (tmp_path / "k.key").mkdir()
    problem = read_secret(str(tmp_path / "k.key"), 32)
    assert problem == f"{tmp_path / 'k.key'} is not a regular file"
