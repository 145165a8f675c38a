"""The shared on-disk primitives: atomic publication, owned-file opens and the strict JSON loader."""

import os
import stat

import pytest

from lm_resiliency.files import atomic_write, loads_strict_json, open_owned


def test_bytes_and_streamed_writes_publish_whole_private_files(tmp_path):
    target = tmp_path / "record.json"
    atomic_write(str(target), b"first")
    atomic_write(str(target), lambda f: (f.write(b"sec"), f.write(b"ond")))
    assert target.read_bytes() == b"second"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["record.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "record.json"
    atomic_write(str(target), b"old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        atomic_write(str(target), broken, temp_name=".record.json.tmp-scoped")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["record.json"]


def test_the_temp_name_is_never_followed_through_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    (tmp_path / ".t").symlink_to(outside)
    with pytest.raises(FileExistsError):
        atomic_write(str(tmp_path / "record"), b"x", temp_name=".t")
    assert outside.read_bytes() == b"keep" and not (tmp_path / "record").exists()


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": 1, "a": 2}', '{"a": Infinity}'])
def test_strict_json_refuses_constants_and_duplicate_keys(text):
    with pytest.raises(ValueError):
        loads_strict_json(text)


class _Refused(Exception):
    pass


def test_open_owned_opens_a_private_file_and_reports_a_missing_one(tmp_path):
    (tmp_path / "shard").write_bytes(b"payload")
    os.chmod(tmp_path / "shard", 0o600)
    fd = open_owned(str(tmp_path / "shard"), "shard", _Refused, forbidden_mode=0o077)
    with os.fdopen(fd, "rb") as f:
        assert os.get_blocking(f.fileno()) and f.read() == b"payload"
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fd = open_owned("shard", "shard", _Refused, dir_fd=dir_fd, flags=os.O_RDWR)
        os.close(fd)
        assert open_owned("absent", "shard", _Refused, dir_fd=dir_fd) is None
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize("kind, reason", [
    ("link", "shard is a symbolic link; refusing to follow it"),
    ("fifo", "shard is not a regular file"),
    ("other-uid", f"shard is owned by uid {os.geteuid()}, not by this process (uid {os.geteuid() + 1})"),
    ("mode", "shard has mode 640; expected 0600 at most"),
])
def test_open_owned_refuses_what_it_must_not_trust(tmp_path, kind, reason):
    target = tmp_path / "shard"
    (tmp_path / "real").write_bytes(b"x")
    uid = None
    if kind == "link":
        target.symlink_to(tmp_path / "real")
    elif kind == "fifo":
        os.mkfifo(target)  # a blocking open would hang this test
    else:
        target.write_bytes(b"x")
        os.chmod(target, 0o640)
        uid = os.geteuid() + 1 if kind == "other-uid" else None
    with pytest.raises(_Refused) as err:
        open_owned(str(target), "shard", _Refused, uid=uid, forbidden_mode=0o077, shown="the shard")
    assert str(err.value).startswith(f"the shard: {reason}")
