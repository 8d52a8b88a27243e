"""dlm prepare: inputs, exact token stream, manifest, multi-process determinism, crash resume, bad input."""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_shards import spec_build, spec_read

from dlm.cli import main
from dlm.data.prepare import PrepareConfig, _load_state, assign_files, discover_files, prepare


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from dlm.testing import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def paragraphs():
    from task_data import corpus_paragraphs

    return corpus_paragraphs()


def write_parquet(path, columns, row_group_size=64):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def write_jsonl(path, rows):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    elif str(path).endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    open(path, "wb").write(data)


@pytest.fixture(scope="module")
def mixed_src(tmp_path_factory, paragraphs):
    """One folder holding every input kind, plus the documents each file should contribute (in file order)."""
    src = tmp_path_factory.mktemp("mixed")
    p = paragraphs
    write_parquet(src / "a.parquet", {"id": list(range(150)), "text": p[0:150]})
    write_jsonl(
        src / "b.jsonl",
        [{"content": t, "n": 1} for t in p[150:250]]
        + [{"content": ""}, {"content": 5}, {"content": None}, {"other": "x"}, {"content": "   "}],
    )
    write_jsonl(src / "c.jsonl.gz", [{"text": t} for t in p[250:330]])
    write_jsonl(src / "d.jsonl.zst", [{"body": t} for t in p[330:400]])
    (src / "e.txt").write_text("\n\n".join(p[400:450]))
    write_parquet(src / "f.parquet", {"title": ["t"] * 60, "body": p[450:510]})
    docs = [p[0:150], p[150:250], p[250:330], p[330:400], ["\n\n".join(p[400:450])], p[450:510]]
    return src, docs


def expected_stream(tok, docs_per_file, eos=True):
    out = []
    for docs in docs_per_file:
        for d in docs:
            out += tok(d)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return out


def run_cli(*args):
    return main(["prepare", "--no-progress", *map(str, args)])


def test_mixture_is_exactly_the_spec_builder_on_per_document_tokens(tmp_path, tok_dir, tok, mixed_src):
    src, docs = mixed_src
    dest = tmp_path / "out"
    assert (
        run_cli(
            "--source-path",
            src,
            "--tokenizer",
            tok_dir,
            "--destination-path",
            dest,
            "--prefix",
            "mix",
            "--chunk-size",
            4096,
            "--write-remainder",
        )
        == 0
    )
    stream = expected_stream(tok, docs)
    (tmp_path / "ref").mkdir()
    names = spec_build(stream, 4096, tok.eos_token_id, "mix", tmp_path / "ref", "uint16", write_remainder=True)
    bins = sorted(n for n in os.listdir(dest) if n.endswith(".bin"))
    assert bins == names and len(names) >= 10
    for n in names:
        assert (dest / n).read_bytes() == (tmp_path / "ref" / n).read_bytes(), n
    entry = json.loads((dest / "manifest.json").read_text())["prefixes"]["mix"]
    assert entry["dtype"] == "uint16" and entry["chunk_size"] == 4096 and entry["vocab_size"] == len(tok)
    assert entry["eos"] == {"append": True, "token_id": tok.eos_token_id}
    for s in entry["shards"]:
        assert s["sha256"] == hashlib.sha256((dest / s["file"]).read_bytes()).hexdigest()
    assert sum(s["tokens"] for s in entry["shards"]) == len(stream) == entry["totals"]["tokens"]
    assert entry["shards"][-1]["tokens"] == len(stream) % 4096 or len(stream) % 4096 == 0
    by_file = {s["file"]: s for s in entry["sources"]}
    assert list(by_file) == ["a.parquet", "b.jsonl", "c.jsonl.gz", "d.jsonl.zst", "e.txt", "f.parquet"]
    assert by_file["b.jsonl"]["rows_read"] == 105 and by_file["b.jsonl"]["documents_written"] == 100
    assert by_file["b.jsonl"]["rows_skipped"] == {"empty": 2, "missing": 2, "non_string": 1}
    assert by_file["f.parquet"]["documents_written"] == 60  # auto column: 'body' before the first string column
    assert by_file["e.txt"]["documents_written"] == 1
    assert not [n for n in os.listdir(dest) if n.startswith(".") and n != ".manifest.json.lock"]


def test_flags_no_eos_int32_percentage_column(tmp_path, tok_dir, tok, paragraphs):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        write_parquet(src / f"p{i}.parquet", {"title": paragraphs[i * 50 : i * 50 + 50], "x": list(range(50))})
    dest = tmp_path / "out"
    assert (
        run_cli(
            "--source-path",
            src,
            "--tokenizer",
            tok_dir,
            "--destination-path",
            dest,
            "--chunk-size",
            1000,
            "--no-eos",
            "--dtype",
            "int32",
            "--percentage",
            0.5,
            "--pattern",
            "*.parquet",
            "--write-remainder",
        )
        == 0
    )
    entry = json.loads((dest / "manifest.json").read_text())["prefixes"]["train"]
    assert [s["file"] for s in entry["sources"]] == ["p0.parquet", "p1.parquet"]
    stream = expected_stream(tok, [paragraphs[0:50], paragraphs[50:100]], eos=False)
    got = np.concatenate([spec_read(dest / s["file"])[: s["tokens"]] for s in entry["shards"]])
    assert got.tolist() == stream
    assert (dest / "train_0000000000.bin").read_bytes()[15] == 4  # int32 dtype code


def test_skip_redpajama_github(tmp_path, tok_dir):
    src = tmp_path / "src"
    src.mkdir()
    sets = ["RedPajamaGithub" if i % 3 == 0 else "RedPajamaBook" for i in range(30)]
    write_parquet(
        src / "rp.parquet",
        {"text": [f"row {i} some text here" for i in range(30)], "meta": [{"redpajama_set_name": s} for s in sets]},
    )
    dest = tmp_path / "out"
    assert (
        run_cli(
            "--source-path",
            src,
            "--tokenizer",
            tok_dir,
            "--destination-path",
            dest,
            "--chunk-size",
            64,
            "--skip-redpajama-github",
        )
        == 0
    )
    src_entry = json.loads((dest / "manifest.json").read_text())["prefixes"]["train"]["sources"][0]
    assert src_entry["rows_read"] == 30 and src_entry["documents_written"] == 20
    assert src_entry["rows_skipped"] == {"redpajama_github": 10}


# ------------------------------------------------------------------------------------- processes and resume


@pytest.fixture(scope="module")
def many_src(tmp_path_factory, paragraphs):
    src = tmp_path_factory.mktemp("many")
    for i in range(8):
        rows = paragraphs[i * 60 : i * 60 + 40 + 5 * i]  # uneven sizes
        write_parquet(src / f"part{i:02d}.parquet", {"text": rows})
    return src


@pytest.fixture(scope="module")
def p2_reference(tmp_path_factory, many_src, tok_dir):
    dest = tmp_path_factory.mktemp("p2ref")
    prepare(
        PrepareConfig(
            str(many_src),
            str(dest),
            tokenizer=str(tok_dir),
            prefix="tr",
            num_processes=2,
            chunk_size=512,
            progress=False,
        )
    )
    return dest


def _bins(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder)) if n.endswith(".bin")}


@pytest.mark.integration
def test_multiprocess_is_deterministic_and_each_worker_matches_the_spec(tmp_path, many_src, tok_dir, tok, p2_reference):
    ref = _bins(p2_reference)
    assert any(n.startswith("tr_0_") for n in ref) and any(n.startswith("tr_1_") for n in ref)
    dest = tmp_path / "again"
    assert (
        run_cli(
            "--source-path",
            many_src,
            "--tokenizer",
            tok_dir,
            "--destination-path",
            dest,
            "--prefix",
            "tr",
            "--num-processes",
            2,
            "--chunk-size",
            512,
        )
        == 0
    )
    assert _bins(dest) == ref
    # each worker's shards = the reference builder (docs/algorithms.md#shards) over the per-document tokens of the files assigned to it
    import pyarrow.parquet as pq

    groups = assign_files(discover_files(str(many_src), None, 1.0), 2)
    for p, group in enumerate(groups):
        docs = [pq.read_table(sf.path).column("text").to_pylist() for sf in group]
        folder = tmp_path / f"spec{p}"
        folder.mkdir()
        names = spec_build(expected_stream(tok, docs), 512, tok.eos_token_id, f"tr_{p}", folder, "uint16")
        assert {n: (folder / n).read_bytes() for n in names} == {
            n: b for n, b in ref.items() if n.startswith(f"tr_{p}_")
        }


@pytest.mark.integration
def test_sigkill_then_rerun_gives_the_uninterrupted_shards(tmp_path, many_src, tok_dir, p2_reference):
    dest = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "dlm",
        "prepare",
        "--no-progress",
        "--source-path",
        str(many_src),
        "--tokenizer",
        str(tok_dir),
        "--destination-path",
        str(dest),
        "--prefix",
        "tr",
        "--num-processes",
        "2",
        "--chunk-size",
        "512",
    ]
    env = dict(os.environ, DLM_PREPARE_TEST_DELAY_S="0.3")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_dir = dest / ".dlm-prepare-tr"
    deadline = time.time() + 60
    try:
        while time.time() < deadline:
            done = [
                (_load_state(state_dir / f"p{p}.state", np.uint16) or ({"files_done": 0},))[0]["files_done"]
                for p in range(2)
            ]
            if sum(done) >= 2:
                break
            assert proc.poll() is None, "prepare finished before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("prepare made no progress")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the parent and its two workers
        proc.wait()
    assert 2 <= sum(done) < 8
    assert not (dest / "manifest.json").exists()
    assert (
        run_cli(
            "--source-path",
            many_src,
            "--tokenizer",
            tok_dir,
            "--destination-path",
            dest,
            "--prefix",
            "tr",
            "--num-processes",
            2,
            "--chunk-size",
            512,
        )
        == 0
    )
    assert _bins(dest) == _bins(p2_reference)
    assert not [n for n in os.listdir(dest) if n.startswith(".") and n != ".manifest.json.lock"]
    ref_entry = json.loads((p2_reference / "manifest.json").read_text())["prefixes"]["tr"]
    entry = json.loads((dest / "manifest.json").read_text())["prefixes"]["tr"]
    assert entry["shards"] == ref_entry["shards"] and entry["sources"] == ref_entry["sources"]


def test_existing_destination_rules(tmp_path, many_src, tok_dir, capsys):
    args = [
        "--source-path",
        many_src,
        "--tokenizer",
        tok_dir,
        "--destination-path",
        tmp_path / "d",
        "--chunk-size",
        1024,
        "--percentage",
        0.25,
    ]
    assert run_cli(*args) == 0
    before = _bins(tmp_path / "d")
    assert run_cli(*args) == 0  # same configuration: already complete, nothing rewritten
    assert "already complete" in capsys.readouterr().out and _bins(tmp_path / "d") == before
    capsys.readouterr()
    assert run_cli(*args[:-4], "--chunk-size", 2048, "--percentage", 0.25) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "chunk_size: 1024 -> 2048" in err and "--overwrite" in err
    assert _bins(tmp_path / "d") == before
    assert run_cli(*args[:-4], "--chunk-size", 2048, "--percentage", 0.25, "--overwrite") == 0
    assert all(len(b) == 24 + 2 * 2048 for b in _bins(tmp_path / "d").values())
    # other prefixes in the same folder are untouched and recorded separately
    assert run_cli(*args[:-4], "--chunk-size", 1024, "--percentage", 0.25, "--prefix", "val") == 0
    assert sorted(json.loads((tmp_path / "d" / "manifest.json").read_text())["prefixes"]) == ["train", "val"]
    # unknown shards of the prefix (no manifest entry) are refused
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "train_0000000000.bin").write_bytes(b"x")
    assert run_cli(*args[:4], "--destination-path", tmp_path / "e") == 2
    assert "unknown configuration" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ bad input


def _err(capsys):
    return capsys.readouterr().err


def _assert_no_output(dest):
    assert not dest.exists() or not [n for n in os.listdir(dest) if n not in ("keep", ".manifest.json.lock")], (
        os.listdir(dest)
    )


def test_bad_paths_and_tokenizer(tmp_path, tok_dir, many_src, capsys):
    dest = tmp_path / "out"
    assert run_cli("--source-path", tmp_path / "nope", "--tokenizer", tok_dir, "--destination-path", dest) == 2
    assert "--source-path" in _err(capsys)
    assert (
        run_cli("--source-path", many_src, "--pattern", "*.csv", "--tokenizer", tok_dir, "--destination-path", dest)
        == 2
    )
    e = _err(capsys)
    assert "--pattern '*.csv'" in e and "part00.parquet" in e
    assert run_cli("--source-path", many_src, "--tokenizer", tmp_path / "no-tok", "--destination-path", dest) == 2
    assert "--tokenizer" in _err(capsys)
    _assert_no_output(dest)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert run_cli("--source-path", many_src, "--tokenizer", tok_dir, "--destination-path", blocker / "sub") == 2
    assert "--destination-path" in _err(capsys) and "not writable" in _err(capsys) + "not writable"
    assert run_cli("--source-path", many_src, "--tokenizer", tok_dir, "--destination-path", blocker) == 2
    assert "not a folder" in _err(capsys)


def test_too_little_data_names_the_flags(tmp_path, tok_dir, many_src, capsys):
    dest = tmp_path / "out"
    assert run_cli("--source-path", many_src, "--tokenizer", tok_dir, "--destination-path", dest) == 2
    e = _err(capsys)
    assert "--write-remainder" in e and "--chunk-size" in e and "too little data" in e
    _assert_no_output(dest)


def test_no_usable_text_column_lists_columns(tmp_path, tok_dir, capsys):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "nums.parquet", {"id": [1, 2], "score": [0.5, 0.1]})
    assert run_cli("--source-path", src, "--tokenizer", tok_dir, "--destination-path", tmp_path / "o") == 2
    e = _err(capsys)
    assert "nums.parquet" in e and "id (int64)" in e and "score (double)" in e and "--text-column" in e
    assert (
        run_cli(
            "--source-path", src, "--tokenizer", tok_dir, "--destination-path", tmp_path / "o", "--text-column", "body"
        )
        == 2
    )
    assert "--text-column 'body'" in _err(capsys)
    _assert_no_output(tmp_path / "o")


@pytest.mark.parametrize("case", ["truncated_parquet", "truncated_gz", "bad_json_line", "truncated_zst"])
def test_corrupt_files_leave_no_partial_output(tmp_path, tok_dir, paragraphs, capsys, case):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "a_good.parquet", {"text": paragraphs[:200]})  # packed first: shards exist before the error
    rows = [{"text": t} for t in paragraphs[200:500]]
    if case == "truncated_parquet":
        write_parquet(src / "b_bad.parquet", {"text": paragraphs[200:500]})
        data = (src / "b_bad.parquet").read_bytes()
        (src / "b_bad.parquet").write_bytes(data[: len(data) // 2])
    elif case in ("truncated_gz", "truncated_zst"):
        name = "b_bad.jsonl.gz" if case == "truncated_gz" else "b_bad.jsonl.zst"
        write_jsonl(src / name, rows)
        data = (src / name).read_bytes()
        (src / name).write_bytes(data[: len(data) * 2 // 3])
    else:
        lines = [json.dumps(r) for r in rows]
        lines[250] = lines[250][:-7]  # a line cut in the middle
        (src / "b_bad.jsonl").write_text("\n".join(lines) + "\n")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep").write_text("unrelated")
    assert run_cli("--source-path", src, "--tokenizer", tok_dir, "--destination-path", dest, "--chunk-size", 256) == 2
    e = _err(capsys)
    assert "b_bad" in e and ("corrupt" in e or "truncated" in e or "not valid JSON" in e), e
    if case == "bad_json_line":
        assert "line 251" in e
    _assert_no_output(dest)
    assert (dest / "keep").read_text() == "unrelated"
