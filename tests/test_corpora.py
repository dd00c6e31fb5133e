"""Subword tokenizers, `python -m hpnlp.data.prepare` and the grain-streamed path
(hpnlp/data/tokenizers.py, prepare.py, sharded.py). Tiny texts and vocabularies."""

import dataclasses
import gzip
import glob
import json
import os
import re
import signal
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpnlp import data
from hpnlp.config import ConfigError, DataConfig, default_configdict, from_configdict, validate
from hpnlp.data import corpus, prepare, sharded, tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ODD = ("  leading spaces\ttab \u2581x\u2581\u2581y\u2581\n\nünïcödé ☃ 字 never seen in training\n"
       "trailing \nno newline at end")


@pytest.fixture(scope="module")
def chapters():
    train, eval_ = corpus.kjv_splits()
    return [c.text for c in train[:60]], [c.text for c in eval_[:8]]


@pytest.fixture(scope="module")
def files(tmp_path_factory, chapters):
    """The chapters as a user's train / eval text files (paragraph = chapter)."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "train.txt").write_text("\n".join(chapters[0]))
    (d / "eval.txt").write_text("\n".join(chapters[1]))
    return str(d / "train.txt"), str(d / "eval.txt")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, files):
    out = str(tmp_path_factory.mktemp("prep") / "bpe")
    assert prepare.main(["--input", files[0], "--eval_input", files[1], "--tokenizer", "bpe",
                         "--vocab_size", "600", "--out", out, "--shard_mb", "0", "--quiet"]) == 0
    return out


def lm_cfg(**kw):
    return DataConfig(**{"task": "byte_lm", "seq_len": 32, **kw})


# ------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_tokenizer_is_deterministic_lossless_and_frequency_sorted(kind, chapters):
    train, eval_ = chapters
    a = tokenizers.train(kind, 600, train)
    b = tokenizers.train(kind, 600, train)
    assert a.model_proto == b.model_proto and np.array_equal(a.order, b.order)
    ids = a.encode_many(eval_)
    assert all(np.array_equal(x, y) for x, y in zip(ids, b.encode_many(eval_)))
    assert a.vocab_size == 600 and all(x.dtype == np.int32 and x.max() < 600 for x in ids)
    for text in eval_ + [ODD, "", "\n", "x"]:  # round trips, unseen characters included
        assert a.decode(a.encode(text)) == text
    counts = sum(np.bincount(x, minlength=600) for x in a.encode_many(train))
    assert np.all(np.diff(counts) <= 0)  # id 0 the most frequent piece
    assert a.decode([a.newline_id]) == "\n"


def test_vocabulary_larger_than_the_text_supports_is_one_clear_line(chapters):
    with pytest.raises(ConfigError, match=r"`data.vocab_size` = 30000 .* at most \d+ unigram pieces"):
        tokenizers.train("unigram", 30000, chapters[0])
    with pytest.raises(ConfigError, match=r"`data.vocab_size` = 100 .* needs at least \d+ pieces"):
        tokenizers.train("bpe", 100, chapters[0])


def test_tokenizer_refuses_bad_ids_and_a_save_that_would_delete_files(tmp_path):
    # found by the crash hunt: save(workdir) deleted the run's files, decode([-1]) decoded the
    # last piece and decode([1.7]) piece 1 silently, encode_many("text") encoded characters
    tok = tokenizers.train("bpe", 300, ["the cat sat on the mat\nthe dog ate the cat"] * 4)
    for ids in ([-1], [300], [1.7], [[1, 2]]):
        with pytest.raises(ValueError, match=r"token ids .* integer ids in \[0, 300\)"):
            tok.decode(ids)
    with pytest.raises(ValueError, match=r"token ids \[-1\]"):
        tok.pieces([-1])
    with pytest.raises(TypeError, match="list of texts"):
        tok.encode_many("the cat")
    with pytest.raises(TypeError, match="list of texts"):
        tokenizers.train("bpe", 300, "the cat")
    # found by a README walk: text whose every line SentencePiece skips (over 64 KiB) failed
    # with the trainer's own check, naming neither the file nor why
    with pytest.raises(ValueError, match=r"^--input big.txt: every line is longer than the "
                       r"65,536 bytes the tokenizer trains on \(the longest 70,002\)"):
        tokenizers.train("bpe", 300, ["ab" * 35001, "cd" * 33000], source="--input big.txt")
    # a review (r6): an empty text's line named neither the file nor the flag
    with pytest.raises(ValueError, match=r"^data.train_path=t.txt: the tokenizer's training "
                       "text is empty"):
        tokenizers.train("bpe", 300, ["", "\n\n"], source="data.train_path=t.txt")
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="holds summary.json, which saving the tokenizer would delete"):
        tok.save(str(tmp_path))
    assert (tmp_path / "summary.json").read_text() == "{}"
    # a review (session 116): a file at the folder's path was told to save to that same path
    (tmp_path / tokenizers.DIRNAME).write_text("a copied model")
    with pytest.raises(ValueError, match=r"tokenizer: is a file, which saving the tokenizer "
                       r"would delete; move or delete that file, or save the tokenizer elsewhere$"):
        tok.save(str(tmp_path / tokenizers.DIRNAME))
    (tmp_path / tokenizers.DIRNAME).unlink()
    tok.save(str(tmp_path / tokenizers.DIRNAME))
    tok.save(str(tmp_path / tokenizers.DIRNAME))  # its own folder is replaced
    assert tokenizers.Subword.load(str(tmp_path / tokenizers.DIRNAME)).decode(tok.encode("cat")) == "cat"
    with pytest.raises(ValueError, match="no such folder; give the folder a tokenizer was saved to"):
        tokenizers.Subword.load(str(tmp_path / "missing"))
    (tmp_path / tokenizers.DIRNAME / tokenizers.MODEL_FILE).write_bytes(b"x")
    with pytest.raises(ValueError, match="does not match tokenizer.json .* delete the folder"):
        tokenizers.Subword.load(str(tmp_path / tokenizers.DIRNAME))


def test_run_keeps_its_tokenizer_in_the_workdir_and_reuses_it(tmp_path, files):
    cfg = lm_cfg(tokenizer="bpe", vocab_size=500, train_path=files[0], eval_path=files[1])
    first = data.make_task(cfg, workdir=str(tmp_path))
    assert first.meta["tokenizer"]["source"] == "trained"
    assert os.path.isfile(tmp_path / "tokenizer" / "tokenizer.model")
    again = data.make_task(cfg, workdir=str(tmp_path))
    assert again.meta["tokenizer"]["source"] == "loaded"
    assert np.array_equal(first.train.tokens, again.train.tokens)
    assert data.task_info(cfg) == {"kind": "lm", "vocab_size": 500, "num_classes": 0,
                                   "frequency_sorted": True}
    assert first.decode(first.encode(ODD)) == ODD
    # a review (session 118): a damaged folder read by a reader of the run, or resumed (a
    # run with a checkpoint), was told "delete the folder to train it again", after which the
    # run could not start at all: told to restore it (a new run's is told to delete it)
    model = tmp_path / tokenizers.DIRNAME / tokenizers.MODEL_FILE
    kept = model.read_bytes()
    model.write_bytes(kept[:len(kept) // 2])
    with pytest.raises(ValueError, match=r"\(a partial copy\?\); restore the run's tokenizer "
                       r"folder from a copy"):
        data.make_task(cfg, workdir=str(tmp_path), save_tokenizer=False)
    os.makedirs(tmp_path / "checkpoints" / "1")  # a run that has saved one keeps its tokenizer
    with pytest.raises(ValueError, match="restore the run's tokenizer folder"):
        data.make_task(cfg, workdir=str(tmp_path))
    model.write_bytes(kept)
    with pytest.raises(ConfigError, match=r"holds a bpe tokenizer of 500 pieces .* unigram of 400"):
        data.make_task(lm_cfg(tokenizer="unigram", vocab_size=400, train_path=files[0],
                              eval_path=files[1]), workdir=str(tmp_path))
    with pytest.raises(ConfigError, match="trained on other text"):
        data.make_task(lm_cfg(tokenizer="bpe", vocab_size=500, train_path=files[1],
                              eval_path=files[0]), workdir=str(tmp_path))
    with pytest.raises(ConfigError, match="`data.tokenizer` = 'bpe' is not allowed for data.task='listops'"):
        data.task_info(DataConfig(task="listops", tokenizer="bpe"))
    cd = default_configdict()
    cd.data.tokenizer = "sentencepiece"
    with pytest.raises(ConfigError, match="data.tokenizer"):
        validate(from_configdict(cd))


# ---------------------------------------------------------------------------- prepare


def test_prepared_shards_read_back_the_in_memory_token_stream(prepared, files):
    mem = data.make_task(lm_cfg(tokenizer="bpe", vocab_size=600, train_path=files[0],
                                eval_path=files[1]))
    cfg = lm_cfg(tokenizer="bpe", vocab_size=600, prepared=prepared)
    task = data.make_task(cfg)
    meta = task.meta["prepared_meta"]
    assert len(meta["splits"]["train"]["shards"]) > 1  # --shard_mb 0: a checkpoint per batch
    for split, ex in (("train", mem.train), ("eval", mem.eval)):
        ds = sharded.split_dataset(prepared, meta, split)
        assert np.array_equal(np.concatenate([ds[i] for i in range(len(ds))]), ex.tokens)
    assert np.array_equal(task.token_counts, mem.token_counts)
    assert task.baseline["unigram_loss"] == pytest.approx(mem.baseline["unigram_loss"], rel=1e-12)
    assert task.decode(task.encode(ODD)) == ODD


def test_prepare_resumes_after_an_interruption(tmp_path, files, prepared, monkeypatch, capsys):
    import shutil
    shutil.copy2(files[0], tmp_path / "train.txt")  # its own copy, edited below
    args = ["--input", str(tmp_path / "train.txt"), "--eval_input", files[1], "--tokenizer",
            "bpe", "--vocab_size",
            "600", "--out", str(tmp_path / "p"), "--shard_mb", "0", "--quiet",
            "--tokenizer_from", prepared]
    real, calls = tokenizers.Subword.encode_many, [0]

    def flaky(self, texts):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        if calls[0] == 3:  # main takes SIGTERM as Ctrl-C (a bug hunt: it said nothing)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, texts)

    monkeypatch.setattr(tokenizers.Subword, "encode_many", flaky)
    for code, what in ((130, "interrupted"), (143, r"stopped \(SIGTERM\)")):
        # before its first shard (found in review: the rerun was refused) and after
        with pytest.raises(prepare.Stopped, match=rf"^{what}; what was checkpointed in "
                           rf"{tmp_path}/p is kept: rerun the same command to continue from it$"
                           ) as stopped:
            prepare.main(args)
        assert stopped.value.exit_code == code
        assert os.path.isfile(tmp_path / "p" / prepare.PROGRESS_FILE)
    with pytest.raises(ConfigError, match="interrupted"):
        sharded.read_meta(str(tmp_path / "p"))
    monkeypatch.setattr(tokenizers.Subword, "encode_many", real)
    # killed between a checkpoint's counts and its progress (a bug hunt, session 93: the
    # counts were the newer, and the rerun counted the documents between twice)
    real_json, cut = prepare.write_json, []

    def killed(path, obj):
        if path.endswith(prepare.PROGRESS_FILE) and not cut:
            cut.append(path)
            raise KeyboardInterrupt
        real_json(path, obj)
    monkeypatch.setattr(prepare, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(args)
    assert cut and len(glob.glob(str(tmp_path / "p" / "progress-counts*.npz"))) == 2
    monkeypatch.setattr(prepare, "write_json", real_json)
    # an input changed since is not resumed at its old offset (a bug hunt)
    stat = os.stat(tmp_path / "train.txt")
    os.utime(tmp_path / "train.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    capsys.readouterr()
    assert prepare.main(args) == 2
    assert "train.txt, which changed since" in capsys.readouterr().err
    os.utime(tmp_path / "train.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # its tokenizer damaged: the fix is a fresh --out (a review, session 116: "delete the
    # folder to train it again" led to "no such folder")
    model = tmp_path / "p" / tokenizers.DIRNAME / tokenizers.MODEL_FILE
    kept = model.read_bytes()
    model.write_bytes(b"x")
    assert prepare.main(args) == 2
    assert (f"the shards kept in {tmp_path}/p were encoded with it: delete {tmp_path}/p to "
            "prepare afresh, or choose a new --out") in capsys.readouterr().err
    model.write_bytes(kept)
    # a second call while another process writes into --out (a review, session 117: it
    # took the other's progress for a stopped run's and removed the shard being written)
    import fcntl
    fd = os.open(tmp_path / "p", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        listed = sorted(os.listdir(tmp_path / "p"))
        assert prepare.main(args) == 2
        assert "another process is writing into it" in capsys.readouterr().err
        assert sorted(os.listdir(tmp_path / "p")) == listed
    finally:
        os.close(fd)
    assert prepare.main(args) == 0
    a, b = sharded.read_meta(prepared), sharded.read_meta(str(tmp_path / "p"))
    for split in ("train", "eval"):
        sa, sb = (sharded.split_dataset(d, m, split) for d, m in ((prepared, a), (str(tmp_path / "p"), b)))
        assert np.array_equal(np.concatenate(list(sa)), np.concatenate(list(sb)))
    assert a["splits"]["train"]["tokens"] == b["splits"]["train"]["tokens"]
    assert np.array_equal(np.load(os.path.join(prepared, sharded.COUNTS_FILE)),
                          np.load(tmp_path / "p" / sharded.COUNTS_FILE))


def test_prepare_reads_json_lines_by_their_usual_names():
    """A review (session 117): .ndjson and .JSONL files were read as text."""
    for name in ("a.jsonl", "a.json", "a.ndjson", "A.JSONL", "b.NDJSON"):
        assert prepare._is_jsonl(name, "auto"), name
    assert not prepare._is_jsonl("a.txt", "auto") and not prepare._is_jsonl("a.jsonl", "text")


def test_prepare_jsonl_and_its_bad_input(tmp_path, capsys):
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} with some words\nsecond line",
                                        "id": i}) + "\n" for i in range(40)))
    assert prepare.main(["--input", str(good), "--out", str(tmp_path / "j"), "--eval_every", "10",
                         "--quiet"]) == 0
    meta = sharded.read_meta(str(tmp_path / "j"))
    assert meta["splits"]["eval"]["documents"] == 4 and meta["splits"]["train"]["documents"] == 36
    assert meta["tokenizer"]["kind"] == "bytes" and meta["dtype"] == "uint8"
    # a subword model learns from the training documents only (found in review: eval's too)
    assert prepare.main(["--input", str(good), "--out", str(tmp_path / "k"), "--eval_every", "10",
                         "--tokenizer", "bpe", "--vocab_size", "290", "--quiet"]) == 0
    docs = [d for d, _, _ in prepare.documents(str(good), fmt="jsonl", text_field="text")]
    assert tokenizers.Subword.load(str(tmp_path / "k" / "tokenizer")).trained_on == \
        tokenizers.text_digest([d for i, d in enumerate(docs) if i % 10 != 9])

    def fails(path_text, *extra):
        p = tmp_path / path_text[0]
        p.write_bytes(path_text[1])
        assert prepare.main(["--input", str(p), "--out", str(tmp_path / ("o_" + path_text[0])),
                             "--quiet", *extra]) == 2
        return capsys.readouterr().err

    err = fails(("b.jsonl", b'{"text": "fine"}\n{"body": "no text"}\n'))
    assert "b.jsonl:2: no 'text' field (has ['body'])" in err and "--text_field" in err
    assert "c.txt: file is empty" in fails(("c.txt", b""))
    assert "d.txt:2: byte 0xe9 is not UTF-8" in fails(("d.txt", b"ok\ncaf\xe9\n"))
    # valid UTF-8 that is no text: NUL bytes, UTF-16 without a byte-order mark (a README
    # walk: both were taken as one document of text)
    for name, raw, line in (("z.txt", b"ok\n" + bytes(1000), 2),
                            ("u.txt", "hi\n\nyo\n".encode("utf-16-le"), 1)):
        assert f"{name}:{line}: a NUL byte, so this is a binary file" in fails((name, raw))
    assert "matches no file" in fails(("e.txt", b"x\n"), "--input", str(tmp_path / "nope*.txt"))
    err = fails(("f.txt", b"".join(b"para %d\n\n" % i for i in range(300))), "--tokenizer",
                "unigram", "--vocab_size", "60000")
    assert "error: --vocab_size 60000: the training text supports at most" in err, err
    # a bug hunt: the eval file as one of the training inputs was taken (eval = train text)
    err = fails(("t.txt", b"x\n"), "--eval_input", str(tmp_path / "t.txt"))
    assert "--eval_input " + str(tmp_path / "t.txt") + " is also an --input" in err, err
    # a review (session 114): taken and ignored (every --input document was trained on)
    (tmp_path / "ev.txt").write_bytes(b"held out\n")
    err = fails(("tr.txt", b"x\n"), "--eval_input", str(tmp_path / "ev.txt"), "--eval_every", "10")
    assert "--eval_every 10 holds out every N-th --input document, and --eval_input names the " \
        "eval text; drop one of the two" in err, err
    # found by the crash hunt: a run's workdir as --out (its tokenizer was replaced), a bad
    # number as a traceback, and an error whose fix led to "an unfinished preparation with
    # other settings" (what the failed call wrote is removed)
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints")
    (run / "config.json").write_text("{}")
    err = fails(("g.txt", b"x\n"), "--out", str(run))
    assert "holds a training run (checkpoints, config.json)" in err
    assert sorted(os.listdir(run)) == ["checkpoints", "config.json"]
    err = fails(("h.txt", b"x\n"), "--tokenizer", "bpe", "--vocab_size", "0")
    assert "--vocab_size 0: it must be >= 1" in err
    three = ("i.txt", b"first\n\nsecond\n\nthird\n")
    assert "no eval document" in fails(three)
    assert not os.path.exists(tmp_path / "o_i.txt")
    assert prepare.main(["--input", str(tmp_path / "i.txt"), "--out", str(tmp_path / "o_i.txt"),
                         "--eval_every", "2", "--quiet"]) == 0


@pytest.mark.parametrize("case", ["empty entry", "json string", "json number text", "utf-16",
                                  "damaged meta", "meta list", "damaged progress",
                                  "progress without counts", "damaged tokenizer_from",
                                  "lone surrogate", "text_field of text", "empty eval_input",
                                  "gzip", "blank input bpe", "bom input bpe",
                                  "vocab_size of bytes", "sample_mb of bytes"])
def test_prepare_bad_input_and_damaged_folders_are_one_line(tmp_path, capsys, case):
    """Each was a traceback or a vague line: an empty --input entry (": no such file"), a JSON
    line that is not an object ("no 'text' field (has str)"), a damaged meta.json or
    progress.json in --out, a damaged --tokenizer_from. Now `error: ...` naming the file or
    flag and the fix, exit 2, and the folder left as it was."""
    text = tmp_path / "a.txt"
    text.write_text("first\n\nsecond\n")
    out = tmp_path / "out"
    args = ["--input", str(text), "--out", str(out), "--eval_every", "2", "--quiet"]
    files = {"empty entry": ("", ""), "damaged meta": ("out/meta.json", "{"),
             "utf-16": ("w.txt", "first\n\nsecond\n".encode("utf-16")),
             "meta list": ("out/meta.json", "[1]"), "damaged progress": ("out/progress.json", "{}"),
             "progress without counts": ("out/progress.json", '{"settings": {}, "state": {}}'),
             "damaged tokenizer_from": ("tok/tokenizer/tokenizer.json", "{"),
             "json string": ("b.jsonl", '"just text"\n'),
             "json number text": ("b.jsonl", '{"text": 3}\n'),
             # found by a bug hunt: a traceback (bytes) or SentencePiece's cast error (bpe)
             "lone surrogate": ("b.jsonl", '{"text": "ok"}\n{"text": "cut \\ud83d"}\n'),
             "text_field of text": ("", ""), "empty eval_input": ("ws.txt", " \n\n\t\n"),
             "gzip": ("w.txt", gzip.compress(b"first\n\nsecond\n")),
             # a review (r6): "the tokenizer's training text is empty", naming nothing
             "blank input bpe": ("ws.txt", " \n\n\t\n"),
             "bom input bpe": ("bom.txt", b"\xef\xbb\xbf\n\n"),
             # a review (r6): taken and ignored, the whole input prepared as bytes
             "vocab_size of bytes": ("", ""), "sample_mb of bytes": ("", "")}
    name, body = files[case]
    if name:
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        (tmp_path / name).write_bytes(body if isinstance(body, bytes) else body.encode())
    if case == "empty entry":
        args[1] += ","
    elif case == "text_field of text":
        args += ["--text_field", "body"]
    elif case == "empty eval_input":  # not with --eval_every (refused as taken and ignored)
        args = [a for i, a in enumerate(args) if i not in (4, 5)]
        assert "--eval_every" not in args
        args += ["--eval_input", str(tmp_path / name)]
    elif case.endswith("input bpe"):
        args[1] = str(tmp_path / name)
        args += ["--tokenizer", "bpe", "--vocab_size", "300"]
    elif case == "vocab_size of bytes":
        args += ["--vocab_size", "500"]
    elif case == "sample_mb of bytes":
        args += ["--tokenizer", "bytes", "--tokenizer_sample_mb", "4"]
    elif name.endswith((".jsonl", "w.txt")):
        args[1] = str(tmp_path / name)
    elif case == "damaged tokenizer_from":
        args += ["--tokenizer_from", str(tmp_path / "tok")]
    before = sorted(os.listdir(out)) if out.exists() else None
    assert prepare.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    want = {"empty entry": "has an empty entry (a stray comma",
            "json string": "b.jsonl:1: a JSON string, not an object",
            "utf-16": "w.txt: starts with a UTF-16 byte-order mark, so it is UTF-16, not UTF-8",
            "json number text": "field 'text' holds a JSON number, not text",
            "damaged meta": "meta.json is damaged (Expecting",
            "meta list": "meta.json is damaged (a JSON array, not an object)",
            "damaged progress": "progress.json is damaged (no 'settings' or 'state' entry)",
            "progress without counts": "without its progress-counts.npz",
            "damaged tokenizer_from": f"--tokenizer_from {tmp_path / 'tok'}: ",
            "lone surrogate": "b.jsonl:2: field 'text' holds '\\ud83d' at character 4, a lone "
                              "UTF-16 surrogate",
            "text_field of text": "--text_field 'body' names a field of JSON lines, but no input",
            "empty eval_input": "ws.txt: no eval text found",
            "gzip": "w.txt: a gzip-compressed file, not text; decompress it first",
            "blank input bpe": "ws.txt: no training text found (every document was empty",
            "bom input bpe": "bom.txt: no training text found (every document was empty",
            "vocab_size of bytes": "--vocab_size 500 sizes a bpe/unigram tokenizer, and the "
                                   "tokenizer is bytes (the default); add --tokenizer bpe or "
                                   "unigram, or drop --vocab_size",
            "sample_mb of bytes": "--tokenizer_sample_mb 4 sizes a bpe/unigram tokenizer, and "
                                  "the tokenizer is bytes (--tokenizer bytes); add --tokenizer "
                                  "bpe or unigram, or drop --tokenizer_sample_mb"}[case]
    assert want in err, err
    assert (sorted(os.listdir(out)) if out.exists() else None) == before


def test_prepare_bad_line_after_written_shards_leaves_a_folder_a_rerun_takes(tmp_path, capsys):
    """A line not UTF-8 met after the first batch was written (before any checkpoint) left
    its shards behind, and the rerun after re-encoding the file was refused ("holds files
    this command would not write"): what it wrote is removed."""
    body = b"".join(b"paragraph %d of some words\n\n" % i for i in range(40000))  # > 1 MiB
    text = tmp_path / "a.txt"
    text.write_bytes(body + b"caf\xe9\n")
    args = ["--input", str(text), "--out", str(tmp_path / "out"), "--batch_mb", "1", "--quiet"]
    assert prepare.main(args) == 2
    assert ":80001: byte 0xe9 is not UTF-8" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    text.write_bytes(body + b"cafe\n")
    assert prepare.main(args) == 0
    # a bug hunt: a rerun after the input was edited was "already prepared" (stale shards)
    assert prepare.main(args) == 0 and "already prepared" in capsys.readouterr().err
    text.write_bytes(body + b"cafe, edited\n")
    assert prepare.main(args) == 2
    assert "a.txt before it changed" in capsys.readouterr().err


def test_prepare_checks_eval_first_and_resumes_after_a_fix_to_a_file_not_read(
        tmp_path, capsys, monkeypatch):
    """A bug hunt (session 96): a bad --eval_input line was met after the whole train split,
    and the fixed file (or a fixed later train file) made the checkpoint unresumable ("which
    changed since"). The eval text is read through first; an edit to a file the checkpoint
    has not read is resumed."""
    a, b, ev = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "ev.jsonl"
    a.write_text("".join(f"paragraph {i} of a\n\n" for i in range(6)))
    b.write_bytes(b"caf\xe9\n\nparagraph of b\n")
    ev.write_text('{"body": "fine eval doc"}\n{"txt": "oops"}\n')
    args = ["--input", f"{a},{b}", "--eval_input", str(ev), "--text_field", "body", "--out",
            str(tmp_path / "p"), "--shard_mb", "0", "--quiet"]
    assert prepare.main(args) == 2
    assert "ev.jsonl:2: no 'body' field" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "p")  # before the train pass
    ev.write_text('{"body": "fine eval doc"}\n{"body": "fixed"}\n')
    assert prepare.main(args) == 2  # checkpointed through a.txt, then b.txt's bad byte
    assert "b.txt:1: byte 0xe9 is not UTF-8" in capsys.readouterr().err
    b.write_text("cafe\n\nparagraph of b\n")
    # an eval file too large to read first: its bad line is met after the train split
    monkeypatch.setattr(prepare, "EVAL_CHECK_MB", -1)
    ev.write_text('{"body": 3}\n{"body": "fine eval doc"}\n')
    assert prepare.main(args) == 2
    assert "ev.jsonl:1: field 'body' holds a JSON number" in capsys.readouterr().err
    ev.write_text('{"body": "fine eval doc"}\n{"body": "fixed"}\n')
    assert prepare.main(args) == 0, capsys.readouterr().err
    fresh = [*args[:-5], "--out", str(tmp_path / "q"), "--quiet"]
    assert prepare.main(fresh) == 0
    m, f = sharded.read_meta(str(tmp_path / "p")), sharded.read_meta(str(tmp_path / "q"))
    for split in ("train", "eval"):
        assert m["splits"][split]["documents"] == f["splits"][split]["documents"]
        assert np.array_equal(np.concatenate(list(sharded.split_dataset(str(tmp_path / "p"), m,
                                                                        split))),
                              np.concatenate(list(sharded.split_dataset(str(tmp_path / "q"), f,
                                                                        split))))
    # an edit to a file a checkpoint has read is still refused
    shutil.rmtree(tmp_path / "p")
    b.write_bytes(b"cafe\n\npara\xe9\n")
    assert prepare.main(args) == 2
    b.write_text("cafe\n\nparagraph of b, edited\n")
    assert prepare.main(args) == 2 and "b.txt, which changed since" in capsys.readouterr().err


def test_prepare_skips_its_own_out_in_the_input_glob_and_refuses_a_file_given_twice(
        tmp_path, capsys, monkeypatch):
    """A bug hunt (session 96): `--input 'c2/*' --out c2/prep` failed on its rerun ("c2/prep:
    is a folder"); a file given twice was read twice (one copy could be eval); the tokenizer
    sample's MiB counted characters."""
    c2 = tmp_path / "c2"
    c2.mkdir()
    (c2 / "a.txt").write_text("".join(f"paragraph {i}\n\n" for i in range(4)))
    args = ["--input", f"{c2}/*", "--out", str(c2 / "prep"), "--eval_every", "2", "--quiet"]
    assert prepare.main(args) == 0
    assert prepare.main(args) == 0 and "already prepared" in capsys.readouterr().err
    assert prepare.main([*args[:1], f"{c2}/pr*", *args[2:]]) == 2
    assert f"--input '{c2}/pr*' matches only --out" in capsys.readouterr().err
    for given, twice in ((f"{c2}/*.txt,{c2}/a.txt", f"{c2}/a.txt: given twice in --input; "),
                         (f"{c2}/*.txt", f"{c2}/b.txt: given twice in --input (as {c2}/a.txt "
                                         f"and {c2}/b.txt); name each file once")):
        assert prepare.main(["--input", given, "--out", str(tmp_path / "d"), "--quiet"]) == 2
        assert twice in capsys.readouterr().err
        os.path.lexists(c2 / "b.txt") or os.symlink(c2 / "a.txt", c2 / "b.txt")  # a.txt again
    snow = tmp_path / "snow.txt"
    snow.write_text("".join("\u2603" * 2000 + "\n\n" for _ in range(100)))

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop
    monkeypatch.setattr(tokenizers, "train", stop)  # the line before its training is enough
    with pytest.raises(Stop):
        prepare.main(["--input", str(snow), "--tokenizer", "bpe", "--out", str(tmp_path / "s"),
                      "--quiet"])
    assert "on 99 documents (0.6 MiB:" in capsys.readouterr().err  # 3 bytes a snowman
    monkeypatch.undo()
    # a review (session 116): --batch_mb counted characters too, so a batch of snowmen was 3x
    # the MiB it names; and a file whose name holds [ was read as a glob
    (tmp_path / "vol[1].txt").write_text("".join("\u2603" * 2000 + "\n\n" for _ in range(600)))
    (tmp_path / "vol1.txt").write_text("another file\n")
    batches, make = [], prepare.make_tokenizer

    def counted(*a, **k):
        encode_many, info, tok = make(*a, **k)
        return (lambda docs: batches.append(len(docs)) or encode_many(docs)), info, tok
    monkeypatch.setattr(prepare, "make_tokenizer", counted)
    assert prepare.main(["--input", str(tmp_path / "vol[1].txt"), "--out",
                         str(tmp_path / "v"), "--batch_mb", "1", "--quiet"]) == 0
    assert sum(batches) == 600 and max(batches) == 175, batches  # 6,000 bytes a document


def test_prepare_refuses_what_its_tokenizer_sample_finds_before_training_it(
        tmp_path, capsys, monkeypatch):
    """A bug hunt (session 98): too few documents for an eval one were said only after the
    tokenizer was trained and everything tokenized; a bad byte met while sampling left an
    empty --out behind."""
    def never(*a, **k):
        raise AssertionError("the tokenizer was trained")
    monkeypatch.setattr(tokenizers, "train", never)
    text = tmp_path / "a.txt"
    for body, err in ((b"first\n\nsecond\n\nthird\n", f"--input {text}: no eval document "
                       "(fewer than --eval_every=4 documents?); lower --eval_every or give "
                       "--eval_input"),
                      (b"ok\n\ncaf\xe9\n", f"{text}:3: byte 0xe9 is not UTF-8")):
        text.write_bytes(body)
        assert prepare.main(["--input", str(text), "--out", str(tmp_path / "p"), "--tokenizer",
                             "bpe", "--vocab_size", "300", "--eval_every", "4", "--quiet"]) == 2
        got = capsys.readouterr().err
        assert got.startswith(f"error: {err}") and got.count("\n") == 1, got
        assert not os.path.exists(tmp_path / "p")


def test_prepare_names_the_setting_a_rerun_changed(tmp_path, capsys, monkeypatch):
    """A bug hunt (session 98): "with other settings" named none, so the same command whose
    glob matches one more file now (or a changed --shard_mb) was refused without saying why."""
    g = tmp_path / "g"
    g.mkdir()
    for name in ("a.txt", "b.txt"):
        (g / name).write_text("".join(f"paragraph {i} of {name}\n\n" for i in range(4)))
    args = ["--input", f"{g}/*", "--out", str(tmp_path / "p"), "--eval_every", "2", "--quiet",
            "--shard_mb", "0"]

    def stop(text):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare.text_tasks, "byte_encode", stop)
    with pytest.raises(prepare.Stopped):
        prepare.main(args)
    monkeypatch.undo()
    (g / "c.txt").write_text("one more\n")
    os.remove(g / "a.txt")
    assert prepare.main(args) == 2
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path}/p holds an unfinished preparation with other settings "
        f"(--input now also matches {g}/c.txt; --input no longer matches {g}/a.txt); rerun it "
        "with its own flags, or choose a new --out\n")
    os.remove(g / "c.txt")
    (g / "a.txt").write_text("paragraph\n\nanother\n")
    args[1] = f"{g}/a.txt,{g}/b.txt"
    assert prepare.main([*args, "--out", str(tmp_path / "q")]) == 0
    assert prepare.main([*args, "--out", str(tmp_path / "q"), "--shard_mb", "2",
                         "--format", "text"]) == 2
    assert "made with other settings (--format: was auto, now text; --shard_mb: was 0, now 2); " \
        "choose a new --out" in capsys.readouterr().err


def test_prepare_takes_its_tokenizer_flags_from_tokenizer_from(tmp_path, files, prepared, capsys):
    """--tokenizer_from alone reuses the tokenizer as it is; flags that contradict it, or
    bytes (which needs none), are one line and write nothing (found by the crash hunt:
    --tokenizer bytes ignored it, and --vocab_size had to be repeated)."""
    base = ["--input", files[0], "--eval_input", files[1], "--quiet", "--tokenizer_from", prepared]
    assert prepare.main([*base, "--out", str(tmp_path / "p")]) == 0
    assert (sharded.read_meta(str(tmp_path / "p"))["tokenizer"]
            == sharded.read_meta(prepared)["tokenizer"])
    for extra, msg in ((["--tokenizer", "bytes"], "--tokenizer bytes needs none"),
                       (["--vocab_size", "500"], "of 600 pieces, not what --vocab_size 500 asks for"),
                       (["--tokenizer", "unigram"], "holds a bpe tokenizer"),
                       (["--tokenizer_sample_mb", "2"],  # taken and ignored (review, s104)
                        "which --tokenizer_sample_mb 2 does not size")):
        assert prepare.main([*base, "--out", str(tmp_path / "q"), *extra]) == 2
        assert msg in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "q")
    # a bug hunt (session 89): a rerun that asks for another tokenizer (here, one trained
    # afresh) was "already prepared" and kept the old one
    assert prepare.main([*base, "--out", str(tmp_path / "p")]) == 0
    assert "already prepared with these settings" in capsys.readouterr().err
    fresh = [*base[:-2], "--tokenizer", "bpe", "--vocab_size", "600"]
    for args in ([*fresh, "--out", str(tmp_path / "p")],
                 [*fresh, "--tokenizer_sample_mb", "1", "--shard_mb", "0", "--out",
                  prepared]):  # the fixture's, trained on the default sample
        assert prepare.main(args) == 2
        assert "made with other settings (--tokenizer_" in capsys.readouterr().err


def test_prepared_folder_of_another_tokenizer_is_refused_before_compile(prepared):
    cd = default_configdict()
    cd.data.update(task="byte_lm", prepared=prepared, seq_len=32)
    cd.model.update(kind="lm", max_len=32)
    with pytest.raises(ConfigError, match=r"prepared with a bpe tokenizer of 600 pieces and this "
                                          r"config asks for bytes; set data.tokenizer='bpe' data.vocab_size=600"):
        validate(from_configdict(cd))
    cd.data.update(tokenizer="bpe", vocab_size=600)
    validate(from_configdict(cd))
    # found by a bug hunt: text files beside a prepared folder were read by nothing
    for field in ("train_path", "eval_path"):
        bad = cd.copy_and_resolve_references()
        bad.data[field] = "train.txt"
        with pytest.raises(ConfigError, match=rf"data.{field}.*data.prepared=.*would not be read"):
            validate(from_configdict(bad))
    with pytest.raises(ConfigError, match="data.prepared.*prepare --input"):
        data.task_info(lm_cfg(prepared=prepared + "_missing"))


def test_a_workdir_holding_another_tokenizer_is_refused_with_a_prepared_folder(prepared,
                                                                               tmp_path):
    """A bug hunt (session 98): a tokenizer folder another run left in the workdir was kept,
    the run trained with the prepared folder's, and its resume was refused, advising to
    prepare the corpus again with the other one. A resume's own folder is taken."""
    cfg = lm_cfg(tokenizer="bpe", vocab_size=600, prepared=prepared)
    own = tmp_path / "own"
    data.make_task(cfg, workdir=str(own))
    assert os.path.isfile(own / tokenizers.DIRNAME / tokenizers.MODEL_FILE)
    data.make_task(cfg, workdir=str(own))  # the run's own, as a resume finds it
    other = tmp_path / "other"
    tokenizers.train("bpe", 300, ["the cat sat on the mat\nthe dog ate the cat"] * 4).save(
        str(other / tokenizers.DIRNAME))
    kept = other / tokenizers.DIRNAME
    with pytest.raises(ConfigError, match=rf"`data.prepared` = .* {kept} holds a bpe tokenizer "
                                          rf"of 300 pieces .*; move {kept} aside, or use a new "
                                          "workdir$"):
        data.make_task(cfg, workdir=str(other))
    assert tokenizers.Subword.load(str(kept)).vocab_size == 300


def test_a_hand_edited_meta_json_is_named(prepared, tmp_path):
    """Found by the crash hunt: read_meta checked only the format, so a meta.json without
    its splits or tokenizer, or with another dtype, failed as a bare KeyError or inside
    numpy/grain."""
    good = sharded.read_meta(prepared)
    for edit, match in ((lambda m: m.pop("splits"), "`splits` has no `train` split"),
                        (lambda m: m["splits"].pop("eval"), "`splits` has no `eval` split"),
                        (lambda m: m["splits"]["train"].update(shards=[]), "`splits.train.shards`"),
                        (lambda m: m["splits"]["eval"].update(tokens="many"), "`splits.eval.tokens`"),
                        (lambda m: m.update(dtype="float32"), "`dtype` = 'float32'"),
                        # a bug hunt (session 96): numpy's "buffer size must be a multiple"
                        (lambda m: m.update(dtype="uint8"), "`dtype` = 'uint8', but the shards "
                                                            "of a vocabulary of 600 hold uint16"),
                        (lambda m: m["tokenizer"].pop("vocab_size"), "`tokenizer` must give")):
        d = tmp_path / "p"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(prepared, d)
        meta = json.loads(json.dumps(good))
        edit(meta)
        (d / sharded.META_FILE).write_text(json.dumps(meta))
        with pytest.raises(ConfigError, match=f"meta.json: {match}.*prepare the folder again"):
            sharded.read_meta(str(d))
    (tmp_path / "p" / sharded.META_FILE).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="has format 'list'"):
        sharded.read_meta(str(tmp_path / "p"))


def test_a_damaged_prepared_folder_is_named_before_any_step(prepared, files, tmp_path, capsys):
    """Found by the crash hunt: a missing or truncated eval shard failed at the first eval,
    after the training steps (and lost them); a missing counts file was a bare Errno. A bug
    hunt (session 96): rerunning the prepare command, as the message said, answered "already
    prepared"; counts of another shape, and a damaged record, failed deep in numpy or grain."""
    cfg = lm_cfg(prepared=str(tmp_path / "p"), tokenizer="bpe", vocab_size=600)
    meta = sharded.read_meta(prepared)
    shard, first = meta["splits"]["eval"]["shards"][0], meta["splits"]["train"]["shards"][0]
    again = "delete the folder and prepare the corpus again"
    rerun = ["--input", files[0], "--eval_input", files[1], "--tokenizer", "bpe", "--vocab_size",
             "600", "--out", str(tmp_path / "p"), "--shard_mb", "0", "--quiet"]
    for damage, match in (("truncate", f"{shard}: cannot be read .*damaged or truncated: {again}"),
                          ("remove", f"{shard}: shard listed in .* is missing; {again}"),
                          ("counts", f"{sharded.COUNTS_FILE}: cannot be read"),
                          ("cut counts", rf"{sharded.COUNTS_FILE}: holds int64 counts of shape "
                                         rf"\[200\], not one count per id .*\(\[600\]\): {again}"),
                          ("record", f"{shard}: cannot be read \\(Corrupted Riegeli.*{again}"),
                          ("tokenizer", "not a readable hpnlp tokenizer .* the shards were encoded "
                                        f"with it: {again}")):
        shutil.rmtree(tmp_path / "p", ignore_errors=True)
        shutil.copytree(prepared, tmp_path / "p")
        path = tmp_path / "p" / {"counts": sharded.COUNTS_FILE, "cut counts": sharded.COUNTS_FILE,
                                 "tokenizer": tokenizers.DIRNAME}.get(damage, shard)
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:-7])
        elif damage == "cut counts":
            np.save(path, np.load(path)[:200])
        elif damage == "record":  # a record's bytes overwritten: the shard still opens
            raw = path.read_bytes()
            path.write_bytes(raw[:100] + b"U" * 50 + raw[150:])
        elif damage == "tokenizer":
            shutil.rmtree(path)
        else:
            os.remove(path)
        with pytest.raises(ValueError, match=match):
            data.make_task(cfg)
        assert prepare.main(rerun) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "already prepared" not in err, err
    # a train shard's damaged record, met while streaming: its name, not grain's traceback
    shutil.rmtree(tmp_path / "p")
    shutil.copytree(prepared, tmp_path / "p")
    raw = (tmp_path / "p" / first).read_bytes()
    (tmp_path / "p" / first).write_bytes(raw[:100] + b"U" * 50 + raw[150:])
    ds = sharded.split_dataset(str(tmp_path / "p"), data.make_task(cfg).meta["prepared_meta"],
                               "train")
    with pytest.raises(ValueError, match=f"{first}: cannot be read \\(Corrupted Riegeli.*{again}"):
        ds[0]
    # a bug hunt (session 98): a shard moved or cut after the run started was array_record's
    # "open() failed" under a 50-line traceback at the next eval
    task = data.make_task(cfg)
    path = tmp_path / "p" / shard
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    with pytest.raises(ValueError, match=f"{shard}: cannot be read .*truncated: {again}"):
        data.make_iterator(task, cfg, split="eval", batch_size=4)
    os.remove(path)
    with pytest.raises(ValueError, match=f"{shard}: shard listed in .*/p/meta.json is missing; "
                                         f"{again}"):
        data.make_iterator(task, cfg, split="eval", batch_size=4)
    # a bug hunt (session 101): a train shard cut while the run read it gave empty records
    # (array_record reads b"" past the cut), and the run trained on to its end on them
    assert prepare.main(["--input", files[0], "--eval_input", files[1], "--tokenizer", "bytes",
                         "--out", str(tmp_path / "b"), "--quiet"]) == 0  # one shard, many records
    meta = sharded.read_meta(str(tmp_path / "b"))
    path = tmp_path / "b" / meta["splits"]["train"]["shards"][0]
    ds = sharded.split_dataset(str(tmp_path / "b"), meta, "train")
    import grain
    other = tmp_path / "b" / meta["splits"]["eval"]["shards"][0]
    source = sharded._named_source(grain)([str(path), str(other)])  # grain's batched reads
    ds[0], source[0]  # the shard opened
    os.truncate(path, path.stat().st_size // 4)
    cut = f"{path}: cannot be read \\(record [0-9]+ is empty; the file changed after the run "
    with pytest.raises(ValueError, match=f"{cut}opened it\\).*{again}"):
        [ds[i] for i in range(len(ds))]
    with pytest.raises(ValueError, match=f"{cut}opened it\\).*{again}"):
        source.__getitems__(list(range(len(ds))))
    # a damaged record of the second shard, read in a batch beside the first's: its own
    # shard named (review: the batch's first key's)
    raw, damaged = other.read_bytes(), tmp_path / "b" / "damaged.array_record"
    damaged.write_bytes(raw[:100] + b"U" * 50 + raw[150:])
    source = sharded._named_source(grain)([str(other), str(damaged)])
    first = len(source) // 2  # the damaged copy's first record, where its bytes were overwritten
    with pytest.raises(ValueError, match=f"{damaged}: cannot be read \\(Corrupted"):
        source.__getitems__([0, first])


# ------------------------------------------------------------------------ streaming


def _resumes_exactly(task, cfg, *, after: int, ahead: int) -> dict:
    """A train iterator's state after `after` batches, through JSON into a new iterator,
    gives the next `ahead` batches again; returns that state."""
    it = data.make_iterator(task, cfg, split="train", batch_size=4)
    for _ in range(after):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(ahead)]
    again = data.make_iterator(task, cfg, split="train", batch_size=4)
    again.set_state(state)
    for a, b in zip(want, [next(again) for _ in range(ahead)]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    return state


@pytest.mark.parametrize("mode", ["pad", "pack", "bucket"])
def test_streamed_batches_resume_exactly_and_split_over_processes(prepared, monkeypatch, mode):
    monkeypatch.setattr(sharded, "WINDOW_BATCHES", 3)  # many windows: resume across them
    cfg = lm_cfg(tokenizer="bpe", vocab_size=600, prepared=prepared, batching=mode)
    task = data.make_task(cfg)
    # A window is one chapter here (12-13 batches of 4 x 32): a review (r3) found that
    # after=7 saved window 0, so grain's reader was never restored at a real position
    state = _resumes_exactly(task, cfg, after=15, ahead=12)
    assert state["window"] >= 1 and state["reader"]["next_index"] > 0, state
    if mode == "bucket":  # a review (r3, r6): a window's bucket plan under other boundaries
        assert state["bucket_boundaries"] == [8, 16, 24, 32]
        other = dataclasses.replace(cfg, bucket_boundaries=(16,))
        with pytest.raises(ValueError, match=re.escape(
                "(data.bucket_boundaries: saved [8, 16, 24, 32], now [16, 32])")):
            data.make_iterator(task, other, split="train", batch_size=4).set_state(state)
        old = {k: v for k, v in state.items() if k != "bucket_boundaries"}  # saved before
        data.make_iterator(task, cfg, split="train", batch_size=4).set_state(old)
    # found by the crash hunt: a malformed position failed deep in numpy or grain
    for edit, match in (({"batch": -1}, "'batch' = -1 .* integer in"), ({"window": "a"}, "'window' = 'a'"),
                        ({"reader": {"x": 1}}, "'reader' = .* not grain's reader state"),
                        # a review (session 107): -1 was grain's bare IndexError, 2.5 a TypeError
                        # in a prefetch thread, True a silent resume at document 1
                        *(({"reader": {"next_index": v}}, f"'reader' = {{'next_index': {v}}} "
                           "is not grain's") for v in (-1, 2.5, True)),
                        ({"reader": [3]}, r"'reader' = \[3\] is not grain's")):
        with pytest.raises(ValueError, match=match):
            data.make_iterator(task, cfg, split="train", batch_size=4).set_state({**state, **edit})
    one = data.make_iterator(task, cfg, split="train", batch_size=4)
    two = [data.make_iterator(task, cfg, split="train", batch_size=4, process_index=p,
                              process_count=2) for p in (0, 1)]
    for _ in range(10):
        whole, halves = next(one), [next(t) for t in two]
        for k in whole:
            assert np.array_equal(whole[k], np.concatenate([h[k] for h in halves]))
    # eval: one pass, every target of the split scored once
    ev = data.make_iterator(task, cfg, split="eval", batch_size=4)
    targets, states, rows = [], [], []
    for b in ev:
        targets.append(b["targets"][b["segment_ids"] > 0])
        states.append(json.loads(json.dumps(ev.get_state())))
        rows.append(int((b["segment_ids"] > 0).any(-1).sum()))
    # found in review: a state saved after a window's last, partial batch failed to load
    ends = [i for i in range(len(states) - 1) if states[i]["window"] != states[i + 1]["window"]]
    i = next((i for i in ends if rows[i] < 4), ends[0])
    again = data.make_iterator(task, cfg, split="eval", batch_size=4)
    with pytest.raises(ValueError, match="'reader' = .* is not grain's"):  # a review (session 107):
        again.set_state({**states[i], "reader": {"next_index": 10**6}})  # grain's IndexError
    again = data.make_iterator(task, cfg, split="eval", batch_size=4)
    again.set_state(states[i])
    assert sum(1 for _ in again) == len(states) - 1 - i
    meta = task.meta["prepared_meta"]["splits"]["eval"]
    assert sum(len(t) for t in targets) == meta["tokens"] - meta["documents"]
    # found by the crash hunt: a state saved at the end of the eval pass failed to load
    # (AttributeError on the missing window); it now resumes as the finished pass
    again = data.make_iterator(task, cfg, split="eval", batch_size=4)
    again.set_state(ev.get_state())
    assert list(again) == []
    assert np.array_equal(np.sort(np.concatenate(targets)), np.sort(np.concatenate(
        [d[1:] for d in sharded.split_dataset(prepared, task.meta["prepared_meta"], "eval")])))


def test_streamed_batches_resume_exactly_across_epoch_boundaries(tmp_path, monkeypatch):
    """A review (session 107): the other streamed resumes stay in epoch 0. Five short documents
    of unequal lengths, a shard each, a window a batch: a state saved in epoch 0 and two in
    later epochs (grain's reader past the split's end, from the fourth on, reshuffled each
    epoch) give the same batches again."""
    monkeypatch.setattr(sharded, "WINDOW_BATCHES", 1)
    train, ev = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    train.write_text("".join(json.dumps({"text": f"doc {i} " + "ab" * 3 * i}) + "\n"
                             for i in range(5)))
    ev.write_text(json.dumps({"text": "held out"}) + "\n")
    out = str(tmp_path / "p")
    assert prepare.main(["--input", str(train), "--eval_input", str(ev), "--out", out,
                         "--shard_mb", "0", "--quiet"]) == 0
    cfg = lm_cfg(prepared=out, seq_len=8)
    task = data.make_task(cfg)
    meta = task.meta["prepared_meta"]["splits"]["train"]
    assert meta["documents"] == len(meta["shards"]) == 5
    at = [_resumes_exactly(task, cfg, after=after, ahead=4)["reader"]["next_index"]
          for after in (3, 9, 13)]
    assert at[0] < 5 < 3 * 5 <= at[1] < at[2]  # the reader's position counts on over epochs


def test_windows_of_one_token_documents_are_skipped_and_a_split_of_them_refused(
        tmp_path, monkeypatch, capsys):
    """Found by a bug hunt: a window of one-token documents (no chunk) ended the stream, so
    an eval pass after 2048 of them scored none of the targets behind them, and a split of
    nothing else trained into a bare StopIteration. Such windows are skipped (resuming
    into the window after them), and prepare refuses a split with no token to predict."""
    monkeypatch.setattr(sharded, "WINDOW_BATCHES", 1)  # 2 x 8 tokens a window
    train, ev = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    train.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    ev.write_text("".join(json.dumps({"text": c}) + "\n" for c in "abcdefghijklmnopqrstuvwxyz" * 2)
                  + "".join(json.dumps({"text": f"held out {i}"}) + "\n" for i in range(3)))
    out = str(tmp_path / "p")
    assert prepare.main(["--input", str(train), "--eval_input", str(ev), "--out", out,
                         "--quiet"]) == 0
    cfg = lm_cfg(prepared=out, seq_len=8)
    task = data.make_task(cfg)
    ev_it = data.make_iterator(task, cfg, split="eval", batch_size=2)
    batches = list(ev_it)
    meta = task.meta["prepared_meta"]["splits"]["eval"]
    assert sum(int((b["segment_ids"] > 0).sum()) for b in batches) == \
        meta["tokens"] - meta["documents"] == 3 * (len("held out 0") - 1)
    # a state saved in the first window with chunks resumes there (its number and reader)
    first = data.make_iterator(task, cfg, split="eval", batch_size=2)
    next(first)
    again = data.make_iterator(task, cfg, split="eval", batch_size=2)
    again.set_state(json.loads(json.dumps(first.get_state())))
    rest = list(again)
    assert len(rest) == len(batches) - 1
    for a, b in zip(batches[1:], rest):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # a train window of mostly one-token documents (fewer rows than a batch) reads on until
    # it has a batch (it had stopped training with "lower the batch size"), and resumes
    mostly = tmp_path / "m.jsonl"
    mostly.write_text("".join(json.dumps({"text": "x" if i % 30 else "a longer one"}) + "\n"
                              for i in range(300)))
    out = str(tmp_path / "pm")
    assert prepare.main(["--input", str(mostly), "--eval_input", str(ev), "--out", out,
                         "--quiet"]) == 0
    cfg = lm_cfg(prepared=out, seq_len=8)
    task = data.make_task(cfg)
    _resumes_exactly(task, cfg, after=1, ahead=3)
    for flag, name in (("--input", "train"), ("--eval_input", "eval")):
        args = {"--input": str(train), "--eval_input": str(ev)}
        one = tmp_path / f"one_{name}.jsonl"
        one.write_text("".join(json.dumps({"text": c}) + "\n" for c in "xyz"))
        args[flag] = str(one)
        assert prepare.main([*sum(args.items(), ()), "--out", str(tmp_path / f"o_{name}"),
                             "--quiet"]) == 2
        assert f"every {name if name == 'eval' else 'training'} document is one token" in \
            capsys.readouterr().err


@pytest.mark.slow
def test_cli_prepare_then_train_resumes_after_sigkill(tmp_path, files):
    """The streamed path end to end in subprocesses: prepare by the CLI, train, SIGKILL after a
    checkpoint, rerun: the same losses and eval as an uninterrupted run."""
    from test_train import kill_and_resume_matches
    out = str(tmp_path / "prep")
    r = subprocess.run([sys.executable, "-m", "hpnlp.data.prepare", "--input", files[0],
                        "--eval_input", files[1], "--tokenizer", "bpe", "--vocab_size", "500",
                        "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prepare: 100%" in r.stderr
    kill_and_resume_matches(tmp_path, [f"--config.data.prepared={out}", "--config.data.tokenizer=bpe",
                                       "--config.data.vocab_size=500"])
    assert os.path.isfile(tmp_path / "kill" / "tokenizer" / "tokenizer.model")


@pytest.mark.slow
def test_generate_cli_decodes_a_subword_run_to_text(tmp_path, files, capsys):
    import importlib
    from hpnlp.train import run
    generate = importlib.import_module("hpnlp.models.generate")  # the module, not the function
    cd = default_configdict()
    cd.data.update(task="byte_lm", tokenizer="bpe", vocab_size=400, train_path=files[0],
                   eval_path=files[1], seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=32, depth=1, num_heads=2, mlp_dim=64, max_len=32)
    cd.train.update(steps=3, batch_size=4, warmup_steps=1, eval_every=0, eval_batches=1,
                    checkpoint_every=3, progress=False)
    run(cd, str(tmp_path))
    prompts = ["And God said", "In the beginning"]
    assert generate.main(["--workdir", str(tmp_path), "--prompt", prompts[0], "--prompt",
                          prompts[1], "--length", "24"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompts[0]) and ("\n" + prompts[1]) in out
    assert generate.main(["--workdir", str(tmp_path), "--prompt", "x" * 28, "--length", "24"]) == 2
    err = capsys.readouterr().err  # (a bug hunt: the bound was not explained)
    assert "every prompt needs 1 to 23 tokens (--length 24); these have [" in err
    assert "]; shorten it, or raise --length (up to the run's model.max_len=32)" in err
    # one that no --length fits is not told to raise it (a bug hunt, session 97)
    assert generate.main(["--workdir", str(tmp_path), "--prompt", "x" * 200, "--length",
                          "24"]) == 2
    err = capsys.readouterr().err
    assert "]; shorten it (the longest --length is the run's model.max_len=32)" in err, err
    # found by the crash hunt: each a line naming the flag, where it had been a traceback or
    # NUL bytes
    for extra, match in ((["--length", "500"], "--length 500 exceeds the run's model.max_len=32"),
                         (["--length", "1"], "--length 1: it counts the prompt too"),
                         (["--length", "0"], "--length 0: it counts the prompt too"),
                         (["--draft-tokens", "3"], "--draft-tokens 3 is for speculative"),
                         (["--temperature", "0"], "--temperature 0.0: sampling needs"),
                         (["--temperature", "nan"], "--temperature nan: sampling needs"),
                         (["--prompt", "\udcff"], "a --prompt is not valid UTF-8")):
        assert generate.main(["--workdir", str(tmp_path), "--prompt", "And", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and "\n" not in err, err
    # speculative decoding, the run drafting for itself: its greedy text, every draft kept
    greedy = ["--workdir", str(tmp_path), "--prompt", prompts[0], "--length", "24", "--greedy"]
    assert generate.main(greedy) == 0
    want = capsys.readouterr().out
    assert generate.main(greedy + ["--draft", str(tmp_path), "--draft-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == want and "speculative:" in err and " target calls after the prompt's; " in err
    assert generate.main(greedy + ["--draft", str(tmp_path), "--draft-tokens", "10"]) == 2
    assert ("error: --length 24 with --draft-tokens 10 writes 33 cache positions, past the "
            "smaller model.max_len=32 of --workdir and --draft; lower --length (to 23 or fewer) "
            "or --draft-tokens (to 9 or fewer)") in capsys.readouterr().err
    # no --length: as long as the caches allow (32 - 4 + 1 tokens)
    assert generate.main(["--workdir", str(tmp_path), "--prompt", prompts[0], "--greedy",
                          "--draft", str(tmp_path)]) == 0
    assert "speculative: " in capsys.readouterr().err
    # an int8 key/value cache: greedy text, and the same text drafting for itself
    assert generate.main(greedy + ["--kv-cache", "int8"]) == 0
    want = capsys.readouterr().out
    assert want.startswith(prompts[0])
    assert generate.main(greedy + ["--kv-cache", "int8", "--draft", str(tmp_path)]) == 0
    assert capsys.readouterr().out == want
    # a quantized folder (PTQ, w8a8 with calibrated activation ranges): decoded with its
    # ranges, its text by the source run's subword model
    from hpnlp.compress import ptq
    from hpnlp.config import QuantConfig
    qdir = str(tmp_path.parent / (tmp_path.name + "_w8a8"))
    ptq.quantize(str(tmp_path), qdir, QuantConfig(weights="int8", activations="int8",
                                                  act_scale="static"),
                 calib_batches=2, eval_batches=1, repeats=1)
    capsys.readouterr()
    assert generate.main(["--workdir", qdir, "--prompt", prompts[0], "--length", "24",
                          "--greedy", "--kv-cache", "int8"]) == 0
    assert capsys.readouterr().out.startswith(prompts[0])
    assert generate.main(greedy + ["--draft", qdir]) == 2
    assert (f"--draft {qdir}: a quantized folder; speculative decoding reads "
            "trained runs: give --draft the run it was quantized from") in capsys.readouterr().err
    assert generate.main(["--workdir", qdir, "--draft", str(tmp_path), "--prompt", "And"]) == 2
    assert f"--workdir {qdir}: a quantized folder" in capsys.readouterr().err  # (a bug hunt)
    # its source's subword model gone: one line, not a tokenizer trained afresh
    os.rename(tmp_path / "tokenizer", tmp_path / "tokenizer.moved")
    assert generate.main(["--workdir", qdir, "--prompt", "And"]) == 2
    err = capsys.readouterr().err.strip()
    assert "subword model of the run it was quantized from" in err and "\n" not in err, err


def test_a_resume_refuses_a_folder_prepared_again_or_a_shard_replaced(tmp_path, files):
    """A bug hunt (session 100): the state held the first shard's name and the token count,
    so a resume trained on a folder prepared again from a text edited at the same length, or
    with a shard copied over another of its size, silently. A state saved before the digest
    (and before the seed mixing, in grain's old order) still resumes, exactly."""
    text = tmp_path / "t.txt"
    text.write_text(open(files[0]).read())
    out = str(tmp_path / "p")
    flags = ["--input", str(text), "--eval_input", files[1], "--out", out, "--shard_mb", "0",
             "--quiet"]
    assert prepare.main(flags) == 0
    cfg = lm_cfg(prepared=out)
    state = _resumes_exactly(data.make_task(cfg), cfg, after=2, ahead=2)
    assert state["order"] == sharded.ORDER and len(state["digest"]) == 16
    again = "prepared again, or a shard replaced, since"
    shutil.rmtree(out)
    text.write_text(open(files[0]).read().replace("God", "Gxd"))
    assert prepare.main(flags) == 0
    task = data.make_task(cfg)
    with pytest.raises(ValueError, match=f"{out}'s train shards: saved .* {again}"):
        data.make_iterator(task, cfg, split="train", batch_size=4).set_state(state)
    state = _resumes_exactly(task, cfg, after=2, ahead=2)
    shard = tmp_path / "p" / task.meta["prepared_meta"]["splits"]["train"]["shards"][1]
    raw = shard.read_bytes()  # its records replaced by others of the same size
    shard.write_bytes(raw[:100] + bytes(reversed(raw[100:150])) + raw[150:])
    with pytest.raises(ValueError, match=again):
        data.make_iterator(task, cfg, split="train", batch_size=4).set_state(state)
    shard.write_bytes(raw)
    # a state of before: no digest, no order (grain's seed data.seed): resumed in that order
    old = data.make_iterator(task, cfg, split="train", batch_size=4)
    old._order, old._reader = None, old._make_reader(None)
    for _ in range(3):
        next(old)
    state = {k: v for k, v in json.loads(json.dumps(old.get_state())).items() if k != "digest"}
    assert "order" not in state
    want = [next(old) for _ in range(2)]
    new = data.make_iterator(task, cfg, split="train", batch_size=4)
    new.set_state(state)
    for a, b in zip(want, [next(new) for _ in range(2)]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert "order" not in new.get_state()  # and its next checkpoint keeps that order


def test_seeds_do_not_share_epochs_and_an_eval_prefix_samples_every_file(tmp_path, monkeypatch):
    """A bug hunt (session 100): grain shuffles epoch e with seed + e, so data.seed 1's first
    epoch was seed 0's second; and the eval pass read the documents in stored order, so
    train.eval_batches scored the first input file's documents only."""
    train, letters, digits = (tmp_path / f"{n}.txt" for n in "tab")
    train.write_text("".join(f"document {i}\n\n" for i in range(52)))
    letters.write_text("".join(f"{c * 12}\n\n" for c in "abcdefghijklmnopqrstuvwxyz" * 2))
    digits.write_text("".join(f"{c * 12}\n\n" for c in "0123456789" * 5))
    out = str(tmp_path / "p")
    assert prepare.main(["--input", str(train), "--eval_input", f"{letters},{digits}", "--out",
                         out, "--quiet"]) == 0
    n = 52  # training documents, an epoch

    def epochs(seed, order=sharded.ORDER):
        cfg = lm_cfg(prepared=out, seed=seed, seq_len=8)
        it = data.make_iterator(data.make_task(cfg), cfg, split="train", batch_size=2)
        reader = it._make_reader(order)
        docs = [bytes(next(reader)) for _ in range(2 * n)]
        return docs[:n], docs[n:]
    assert epochs(1, None)[0] == epochs(0, None)[1]  # grain's own seeds: the bug
    assert epochs(1)[0] != epochs(0)[1] and epochs(0)[0] != epochs(0)[1]
    monkeypatch.setattr(sharded, "WINDOW_BATCHES", 1)
    cfg = lm_cfg(prepared=out, seq_len=8)
    task = data.make_task(cfg)
    per_batch = [b["targets"][b["segment_ids"] > 0] for b in
                 data.make_iterator(task, cfg, split="eval", batch_size=2)]
    is_letter = [np.isin(t, np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)).mean()
                 for t in per_batch]
    quarter = len(per_batch) // 4
    assert 0.2 < np.mean(is_letter[:quarter]) < 0.8  # stored order: 1.0
    meta = task.meta["prepared_meta"]["splits"]["eval"]  # still one pass, every target once
    assert sum(map(len, per_batch)) == meta["tokens"] - meta["documents"]


def test_a_kept_tokenizer_of_other_text_names_the_field_that_chose_it(tmp_path):
    """A review (session 116): a run's tokenizer trained on other text than the config's
    training split was said of data.train_path whatever changed: a run of the shipped corpus
    resumed under another data.eval_split was told train_path = '' (never set), and one whose
    file had changed to use the run's own settings. Each names its field and its fix."""
    folder = str(tmp_path / tokenizers.DIRNAME)
    tokenizers.train("bpe", 300, ["the cat sat on the mat\nthe dog ate the cat"] * 4).save(folder)
    other = ["a bird flew over the hill\nthe fox ran"] * 4
    # a workdir of no checkpoint (its first run stopped before one) starts over: its tokenizer
    # is trained anew and replaced (a review, session 116: it was refused, "a new workdir")
    cfg = DataConfig(task="word_lm", tokenizer="bpe", vocab_size=300, eval_split="validation")
    tok, how = tokenizers.for_run(cfg, other, folder)
    assert how == "trained" and tokenizers.Subword.load(folder).trained_on == tok.trained_on
    tokenizers.train("bpe", 300, ["the cat sat on the mat\nthe dog ate the cat"] * 4).save(folder)
    os.makedirs(tmp_path / "checkpoints" / "3")  # a run that has saved one keeps its own
    for cd, want in ((dict(eval_split="validation"), r"^config field `data.eval_split` = "
                      r"'validation' is not allowed: .* the fields that choose the split "
                      r"\(data.eval_split, data.eval_path\) differ from the run's; use the "
                      r"run's own data settings"),
                     (dict(train_path="t.txt"), r"^config field `data.train_path` = 't.txt' is "
                      r"not allowed: .* the run's file changed since, or the fields .* restore "
                      r"the file, or use")):
        cfg = DataConfig(task="word_lm", tokenizer="bpe", vocab_size=300, **cd)
        with pytest.raises(ConfigError, match=want):
            tokenizers.for_run(cfg, other, folder)
