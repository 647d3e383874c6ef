"""Fine-tuning data from 🤗 datasets (issue 41): a Dataset / IterableDataset with the JSONL formats'
columns gives the examples the same JSONL lines give; local parquet, CSV, JSON and saved folders;
`finetune --data org/name` against a local server laid out as the Hub serves datasets, then offline
from the cache (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); bad datasets are a ValueError naming the
column and the formats; without the datasets package, an ImportError naming the extra."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_hub import FakeHub, _env

import llamabind
from llamabind import train

datasets = pytest.importorskip("datasets")

CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]}
    for i in range(12)
]
ROWS = {
    "text": [{"text": f"Line {i} of a plain text about llamas."} for i in range(6)],
    "prompt-completion": [{"prompt": f"Say {i}", "completion": f"{i}!"} for i in range(6)],
    "messages": CHATS[:6],
}


@pytest.fixture(scope="module")
def model(model_path):
    with llamabind.Model(model_path, n_threads=2, repack=False) as m:
        yield m


def _same(a: list[train.Example], b: list[train.Example]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.counted, y.counted)


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_dataset_rows_are_the_jsonl_lines(fmt, model, tmp_path):
    rows = ROWS[fmt]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = train.load_jsonl(path, model)
    ds = datasets.Dataset.from_list(rows)
    _same(train.from_dataset(ds, model), want)
    _same(train.read_data(ds, model), want)
    _same(train.from_dataset(ds.to_iterable_dataset(), model), want)  # streamed rows too
    # the same rows as local files and folders
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "saved-dict"))
    for spec in ("d.parquet", "saved", "saved-dict"):
        _same(train.read_data(tmp_path / spec, model), want)
    if fmt != "messages":  # flat columns: CSV and a JSON array too
        ds.to_csv(str(tmp_path / "d.csv"), index=False)
        (tmp_path / "d.json").write_text(json.dumps(rows))
        _same(train.read_data(tmp_path / "d.csv", model), want)
        _same(train.read_data(tmp_path / "d.json", model), want)


def test_finetune_takes_a_dataset(model):
    r = train.finetune(model, datasets.Dataset.from_list(CHATS), lora_rank=4, iters=2, val_split=0.25, progress=False)
    assert r.steps == 2 and np.isfinite(r.losses).all() and np.isfinite(r.epochs[-1].val_loss)


def test_a_stream_is_read_for_the_steps_it_trains(model):
    """Issue 60: an endless IterableDataset (from_generator) with iters=2 reads the rows of 2 steps
    and its held-out share, and trains; without iters it is refused (its length is not known), and
    nothing is read; from_dataset's limit reads the first rows of a stream (a streamed valid's 25 batches)."""
    read = []

    def endless():
        i = 0
        while True:
            read.append(i)
            yield CHATS[i % len(CHATS)]
            i += 1

    stream = datasets.IterableDataset.from_generator(endless)
    r = train.finetune(model, stream, lora_rank=4, iters=2, batch_size=2, val_split=0.25, progress=False)
    assert r.steps == 2 and np.isfinite(r.losses).all()
    assert len(read) < 20, len(read)  # ceil(2 * 2 / 0.75) + 1 = 7 rows, and the generator's lookahead
    read.clear()
    with pytest.raises(ValueError, match="streaming dataset .* give iters"):
        train.finetune(model, stream, lora_rank=4, progress=False)
    assert not read
    read.clear()  # what finetune reads of a streamed valid: its first 25 batches (from_dataset's limit)
    assert len(train.from_dataset(stream, model, limit=25)) == 25 and len(read) < 40, len(read)


def test_bad_datasets_are_clear_errors(model, tmp_path):
    with pytest.raises(ValueError, match=r"columns \['question', 'answer'\].*'messages' column"):
        train.from_dataset(datasets.Dataset.from_list([{"question": "q", "answer": "a"}]), model)
    with pytest.raises(ValueError, match="empty"):
        train.from_dataset(datasets.Dataset.from_list([{"text": "x"}]).select([]), model)
    with pytest.raises(ValueError, match="row 1: field 'text' must be a str"):
        train.from_dataset(datasets.Dataset.from_list([{"text": "a"}, {"text": None}]), model)
    with pytest.raises(ValueError, match="row 0: messages"):
        train.from_dataset(datasets.Dataset.from_list([{"messages": ["not a message"]}]), model)
    with pytest.raises(ValueError, match="not a dataset file"):
        (tmp_path / "x.bin").write_bytes(b"\0")
        train.load_dataset(str(tmp_path / "x.bin"))
    with pytest.raises(FileNotFoundError, match="Hub dataset id"):
        train.read_data(tmp_path / "missing" / "deeper" / "x.parquet", model)
    d = tmp_path / "dd"
    datasets.DatasetDict(test=datasets.Dataset.from_list([{"text": "x"}])).save_to_disk(str(d))
    with pytest.raises(ValueError, match="no 'train' split"):
        train.load_dataset(str(d))


def test_without_datasets_an_import_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"llamabind\[train\]"):
        train.load_dataset("org/name")


def test_cli_finetune_on_a_hub_dataset_then_offline(model_path, tmp_path):
    """`python -m llamabind finetune --data org/name` (LoRA, 2 steps) through huggingface_hub against
    a local server laid out as the Hub serves dataset repositories, then with the network gone and
    the offline switches on, from the cache it filled."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    readme = tmp_path / "README.md"
    readme.write_text("---\nlicense: mit\n---\n# arithmetic chats\n")
    srv = FakeHub({"datasets/test-org/chats": {"README.md": readme, "data/train.jsonl": data}})
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cmd = [sys.executable, "-m", "llamabind", "finetune", "-m", str(model_path), "--data", "test-org/chats",
               "--lora-rank", "4", "--iters", "2", "--val-split", "0.25", "--no-progress",
               "--threads", "2"]  # fmt: skip
        env = _env(tmp_path, srv.url)
        p = subprocess.run([*cmd, "-o", str(tmp_path / "a.gguf")], env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "12 examples from test-org/chats" in p.stderr and "2 optimizer steps" in p.stdout, p.stderr[-2000:]
        assert any("/data/train.jsonl" in path for _, path in srv.log)
    finally:
        srv.shutdown()
        srv.server_close()
    offline = {**_env(tmp_path, None, offline=True), "HF_DATASETS_OFFLINE": "1"}
    p = subprocess.run([*cmd, "-o", str(tmp_path / "b.gguf")], env=offline, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "12 examples from test-org/chats" in p.stderr
    bad = subprocess.run([*cmd[:7], "nowhere/none", *cmd[8:], "-o", str(tmp_path / "c.gguf")], env=offline,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "nowhere/none" in bad.stderr, bad.stderr[-2000:]


def test_cli_finetune_bad_input_is_one_error_line(model_path, tmp_path, capsys, monkeypatch):
    """Issue 60 item 3, through the CLI as a user types it: each bad --data / --valid / --test / flag gives
    exit status 2 and one ``error: ...`` line naming the file or flag and what is wrong, never a traceback
    (a saved dataset with no rows was an IndexError traceback, a CSV of random bytes datasets' bare
    DatasetGenerationError, a binary file a utf-8 decode error naming no file). In-process: every case is
    refused in Python before any llama.cpp call that could abort."""
    from llamabind import cli

    datasets.Dataset.from_list([]).save_to_disk(str(tmp_path / "emptyds"))
    (tmp_path / "rand.csv").write_bytes(bytes(range(128, 256)) * 20)
    (tmp_path / "x.bin").write_bytes(b"\x00\xff\xfe" * 100)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "afile").write_text("x")
    ok = tmp_path / "ok.jsonl"
    ok.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    cases = [
        (["--data", "emptyds"], r"emptyds: a saved dataset with no rows"),
        (["--data", "rand.csv"], r"rand.csv: could not be read as a dataset .*because UnicodeDecodeError"),
        (["--data", "x.bin"], r"x.bin: not UTF-8 text, JSONL or a dataset file"),
        (["--data", "empty.jsonl"], r"empty.jsonl: the file is empty"),
        (["--data", "nope.jsonl"], r"--data: no such file or folder.*nope.jsonl"),
        (["--data", "ok.jsonl", "--valid", "empty.jsonl"], r"empty.jsonl: the file is empty"),
        (["--data", "ok.jsonl", "--test", "x.bin"], r"x.bin: not UTF-8"),
        (["--data", "ok.jsonl", "--checkpoint-dir", "afile", "--save-every", "1"], r"checkpoint_dir 'afile' is a file"),
        (["--data", "ok.jsonl", "--resume", "afile"], r"no checkpoint in afile"),
        (["--data", "ok.jsonl", "--lora-alpha", "0"], r"lora_alpha must be > 0"),
        (["--data", "ok.jsonl", "--lora-targets", "banana"], r"lora target must be one of .*got 'banana'"),
        (["--data", "ok.jsonl", "--batch", "0"], r"batch_size must be in \[1, 65536\]; got 0"),
        (["--data", "ok.jsonl", "--grad-accum", "0"], r"grad_accum must be in \[1, 65536\]; got 0"),
        (["--data", "ok.jsonl", "--val-split", "2"], r"val_split must be in \[0.0, 0.9\]; got 2.0"),
        (["--data", "ok.jsonl", "--chat-template-file", "nope.j2"], r"--chat-template-file: no such file: nope.j2"),
        (["--data", "ok.jsonl", "-o", str(tmp_path / "no" / "dir" / "a.gguf")], r"-o: cannot write .*a.gguf"),
    ]
    base = ["finetune", "-m", str(model_path), "--lora-rank", "2", "--iters", "1", "--no-progress", "-t", "2"]
    monkeypatch.chdir(tmp_path)
    for extra, match in cases:
        argv = [*base, *extra] if "-o" in extra else [*base, *extra, "-o", "out.gguf"]
        rc = cli.main(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (extra, err[-2000:])
        assert re.search(match, lines[0]), (extra, lines[0])
    assert not (tmp_path / "out.gguf").exists()
