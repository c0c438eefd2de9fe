"""file_in_the_way: the existing ancestor that is a file, where a folder must be made."""

from __future__ import annotations

from fp8serve.utils.paths import file_in_the_way


def test_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    assert file_in_the_way(tmp_path / "f" / "a" / "b.json") == tmp_path / "f"
    assert file_in_the_way(tmp_path / "f" / "x") == tmp_path / "f"
    assert file_in_the_way(tmp_path / "d" / "new" / "x") is None
    assert file_in_the_way(tmp_path / "new") is None
    assert file_in_the_way(tmp_path / "f") is None  # the path itself is the caller's business
