"""minisparse/utils/files.py: a file written atomically is the old one or the whole new one,
and a write that fails leaves the old file and no temporary behind."""
import os

import pytest

from minisparse.utils.files import atomic_write


def test_writes_text_and_bytes_and_makes_the_folder(tmp_path):
    path = tmp_path / "new" / "a.json"
    with atomic_write(path) as f:
        f.write("é\n")
    assert path.read_text(encoding="utf-8") == "é\n"
    assert os.stat(path).st_mode & 0o777 == 0o644
    with atomic_write(path, "wb") as f:
        f.write(b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(path.parent) == ["a.json"]


def test_the_old_file_stays_until_the_block_ends_and_after_a_failure(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half")
            f.flush()
            assert path.read_text() == "old" and open(f.name).read() == "half"
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.txt"]
