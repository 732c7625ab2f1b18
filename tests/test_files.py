"""mdjax.files: one atomic writer for files and one for directories (design: bad input
loses nothing)."""

import pytest

from mdjax import files


def test_atomic_file_replaces_the_target_in_one_rename(tmp_path):
  target = tmp_path / "sub" / "out.json"
  files.write_text(target, "old")
  with files.atomic_file(target) as partial:
    partial.write_text("new")
    assert target.read_text() == "old"  # a reader still sees the whole old file
    assert partial.parent == target.parent and partial.suffix == ".json"
  assert target.read_text() == "new"
  assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_an_interrupted_atomic_write_leaves_the_old_file_and_no_partial(tmp_path):
  target = tmp_path / "out.txt"
  files.write_text(target, "old")
  with pytest.raises(RuntimeError):
    with files.atomic_file(target) as partial:
      partial.write_text("half")
      raise RuntimeError("killed mid-write")
  assert target.read_text() == "old"
  assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_an_interrupted_directory_write_leaves_the_old_directory(tmp_path):
  target = tmp_path / "heads"
  with files.atomic_directory(target) as staging:
    (staging / "a").write_text("1")
  with pytest.raises(RuntimeError):
    with files.atomic_directory(target) as staging:
      (staging / "a").write_text("2")
      raise RuntimeError("killed")
  assert (target / "a").read_text() == "1"
  assert [p.name for p in tmp_path.iterdir()] == ["heads"]
