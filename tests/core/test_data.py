"""`agentrl.data.read_rows`: every --dataset format, bad rows by file and line, empty datasets."""

from __future__ import annotations

import json

import pytest

from agentrl.data import DataError, read_rows

ROWS = [{"prompt": "a", "label": 1}, {"prompt": "b", "label": 2}]


def test_jsonl_json_parquet_and_datasets_directories_read_alike(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "hfdict"))
    for name in ("d.jsonl", "d.json", "d.parquet", "hf", "hfdict"):
        got = read_rows(tmp_path / name, keys=("prompt",))
        assert got.rows == ROWS and len(got.where) == 2, name
    assert read_rows(tmp_path / "d.jsonl").where == [f"{tmp_path}/d.jsonl:1",
                                                     f"{tmp_path}/d.jsonl:2"]


def test_bad_rows_stop_or_are_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{oops\n[1, 2]\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:3: not valid JSON"):
        read_rows(path, keys=("prompt",))
    got = read_rows(path, keys={"prompt": "--dataset.prompt_key"}, on_bad="skip")
    assert got.rows == [ROWS[0]] and len(got.skipped) == 3
    assert "d.jsonl:4: a row must be a JSON object" in got.skipped[1]
    assert "d.jsonl:5: no 'prompt' key" in got.skipped[2]
    assert "--dataset.prompt_key" in got.skipped[2]


def test_empty_missing_and_unknown_datasets_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="has no usable rows"):
        read_rows(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset format '.csv'"):
        read_rows(tmp_path / "d.csv")
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="not a directory datasets can read"):
        read_rows(tmp_path / "dir")
