"""The shared on-disk primitives: atomic publication and the strict JSON loader."""

import os
import stat

import pytest

from lm_resiliency.files import atomic_write, loads_strict_json


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
