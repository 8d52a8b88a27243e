"""Faults with nothing lost: a full disk during ``dlm prepare`` and during a checkpoint save, SIGKILL at random
moments of checkpoint writes, and damaged inputs (shards, manifest.json, checkpoint files, config.json, weights,
adapters): a one-line error naming the file, exit code 2, the complete outputs kept, and a rerun that resumes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm.cli import main
from dlm.errors import DLMError

WORDS = "the cat sat on a mat and the dog sat on the log to be or not to be that is the question".split()


def text_files(folder: Path, n: int, words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(words // 30)]
        (folder / f"part{i:02d}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from dlm.testing import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return path


def one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert needle in errors[0], errors[0]
    return errors[0]


def flip_byte(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x40
    path.write_bytes(bytes(b))


def truncate(path: Path, keep: float = 0.5) -> None:
    b = path.read_bytes()
    path.write_bytes(b[: int(len(b) * keep)])


# ============================================================================================ a small filesystem
@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of a given size (bytes) at ``tmp_path/fs``; ``resize(n)`` grows it ("space freed"). Skipped where
    the machine does not let the tests mount (not root, or a container without CAP_SYS_ADMIN)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mounted = []

    def make(size: int):
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(
                f"cannot mount a size-limited tmpfs here ({r.stderr.strip() or 'mount failed'}); the "
                f"disk-full tests need root or CAP_SYS_ADMIN"
            )
        mounted.append(mnt)
        return mnt

    def resize(size: int):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)

    make.resize = resize
    yield make
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def prepare_args(src, dest, tok_dir, *extra):
    return [
        "prepare",
        "--source-path",
        str(src),
        "--destination-path",
        str(dest),
        "--tokenizer",
        str(tok_dir),
        "--chunk-size",
        "4096",
        "--no-progress",
        *extra,
    ]


@pytest.mark.integration
def test_disk_full_during_prepare_keeps_finished_shards_and_resumes(tmp_path, small_fs, tok_dir, capsys):
    from dlm.data.loader import PackedDataset
    from dlm.data.shards import read_header

    src = text_files(tmp_path / "src", 8, 6000)
    ref = tmp_path / "ref"
    assert main(prepare_args(src, ref, tok_dir)) == 0
    ref_shards = {p.name: p.read_bytes() for p in ref.glob("train_*.bin")}
    total = sum(len(b) for b in ref_shards.values())
    assert len(ref_shards) >= 8, len(ref_shards)

    fs = small_fs(total // 3)
    dest = fs / "packed"
    capsys.readouterr()
    assert main(prepare_args(src, dest, tok_dir)) == 2
    line = one_line_error(capsys, "no space left on the device")
    assert str(dest) in line and "free of" in line and "rerun the same command" in line
    kept = sorted(dest.glob("train_*.bin"))
    assert kept, "finished shards were deleted"
    assert not list(dest.glob(".*.tmp*")), "half-written files left behind"
    for p in kept:  # every finished shard is complete, loadable and exactly what the full run wrote
        read_header(p)
        assert p.read_bytes() == ref_shards[p.name], p.name
    assert len(list(PackedDataset(kept, 4096, shuffle=False))) == len(kept)

    small_fs.resize(total * 4)
    assert main(prepare_args(src, dest, tok_dir)) == 0
    assert {p.name: p.read_bytes() for p in dest.glob("train_*.bin")} == ref_shards
    entry = json.loads((dest / "manifest.json").read_text())["prefixes"]["train"]
    assert (
        entry["totals"]["tokens"]
        == json.loads((ref / "manifest.json").read_text())["prefixes"]["train"]["totals"]["tokens"]
    )


# ============================================================================================ training runs
def chat_file(path: Path, n: int = 48) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"The answer is {2 * i}."}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from dlm.testing import save_tiny

    root = tmp_path_factory.mktemp("faults")
    return {"model": save_tiny(root / "tiny"), "data": chat_file(root / "chat.jsonl"), "root": root}


def train_args(t, out, steps=6, *extra):
    return [
        "train",
        "--model",
        str(t["model"]),
        "--data",
        str(t["data"]),
        "--objective",
        "idlm",
        "--block-size",
        "2",
        "--seq-length",
        "48",
        "--batch-size",
        "4",
        "--max-train-steps",
        str(steps),
        "--learning-rate",
        "1e-3",
        "--save-every",
        "2",
        "--keep-last",
        "1",
        "--output-dir",
        str(out),
        "--train.progress",
        "false",
        "--eval-every",
        "0",
        *extra,
    ]


def losses(out: Path) -> dict[int, tuple]:
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    start = max(i for i, r in enumerate(recs) if r.get("event") in ("start", "resume"))
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in recs[start + 1 :] if "loss" in r}


@pytest.fixture(scope="module")
def reference(tiny_run):
    out = tiny_run["root"] / "ref"
    assert main(train_args(tiny_run, out)) == 0
    return out, losses(out)


@pytest.mark.integration
def test_disk_full_during_checkpoint_save_keeps_the_last_one_and_resumes(tiny_run, reference, small_fs, capsys):
    from dlm.train.checkpoint import latest_checkpoint, read_state

    ref_out, ref_losses = reference
    ckpt_bytes = sum(p.stat().st_size for p in (ref_out / "checkpoints").rglob("*") if p.is_file())
    fs = small_fs(int(ckpt_bytes * 1.6))  # the first checkpoint fits, the second (written beside it) does not
    out = fs / "run"
    capsys.readouterr()
    assert main(train_args(tiny_run, out)) == 2
    line = one_line_error(capsys, "no space left on the device")
    assert "checkpoints" in line and "free of" in line and "--resume auto" in line
    last = latest_checkpoint(out / "checkpoints")
    assert last is not None and read_state(last)["step"] == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"], "a temp folder was left"
    from dlm.fsutil import verify_checksums

    assert verify_checksums(last, "checkpoint")  # intact and loadable: every file as written

    small_fs.resize(ckpt_bytes * 20)
    assert main(train_args(tiny_run, out, 6, "--resume", "auto")) == 0
    resumed = losses(out)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(resumed[s] == ref_losses[s] for s in resumed)  # the loss curve continues exactly


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["optimizer_flip", "weights_truncated", "state_json_truncated", "rank_flip"])
def test_damaged_checkpoint_is_a_clear_error_naming_the_file(tiny_run, reference, tmp_path, capsys, damage):
    ref_out, _ = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    ck = out / "checkpoints" / "step_00000006"
    target = {
        "optimizer_flip": ck / "training_state" / "optimizer.bin",
        "weights_truncated": ck / "training_state" / "pytorch_model.bin",
        "state_json_truncated": ck / "trainer_state.json",
        "rank_flip": ck / "training_state" / "dlm_rank0.pt",
    }[damage]
    if damage.endswith("flip"):
        flip_byte(target, target.stat().st_size // 2)
    else:
        truncate(target)
    capsys.readouterr()
    assert main(train_args(tiny_run, out, 8, "--resume", "auto")) == 2
    one_line_error(capsys, str(target))


# ============================================================================================ damaged data files
@pytest.fixture(scope="module")
def packed(tmp_path_factory, tok_dir):
    root = tmp_path_factory.mktemp("packed")
    src = text_files(root / "src", 3, 3000)
    assert main(prepare_args(src, root / "out", tok_dir, "--chunk-size", "512")) == 0
    return root / "out"


@pytest.mark.parametrize(
    "damage", ["truncated", "header_flip", "payload_flip", "manifest_truncated", "manifest_sha_changed"]
)
def test_damaged_shards_and_manifest_name_the_file(packed, tmp_path, damage):
    from dlm.data.loader import build_packed_dataset

    data = tmp_path / "data"
    shutil.copytree(packed, data)
    shard = sorted(data.glob("train_*.bin"))[1]
    manifest = data / "manifest.json"
    if damage == "truncated":
        truncate(shard, 0.7)
    elif damage == "header_flip":
        flip_byte(shard, 16)  # the chunk size
    elif damage == "payload_flip":
        flip_byte(shard, 24 + 2 * 100)
    elif damage == "manifest_truncated":
        truncate(manifest)
    else:
        m = json.loads(manifest.read_text())
        sh = m["prefixes"]["train"]["shards"][1]
        sh["sha256"] = ("0" if sh["sha256"][0] != "0" else "1") + sh["sha256"][1:]
        manifest.write_text(json.dumps(m))
    with pytest.raises(DLMError) as e:
        ds = build_packed_dataset(data, "train", block_size=128, wrap=False)
        for _ in ds:
            pass
    msg = str(e.value)
    assert str(manifest if damage == "manifest_truncated" else shard) in msg, msg
    assert "\n" not in msg


def test_shards_without_a_manifest_are_read_unverified(packed, tmp_path):
    """TinyLlama's own shards have no manifest: they load (header and size checked), nothing is hashed."""
    from dlm.data.loader import build_packed_dataset

    data = tmp_path / "data"
    shutil.copytree(packed, data)
    (data / "manifest.json").unlink()
    ds = build_packed_dataset(data, "train", block_size=128, wrap=False)
    assert sum(1 for _ in ds) > 0


def test_damaged_prepare_checkpoint_names_the_file(tmp_path, tok_dir, capsys):
    """An interrupted prepare whose worker checkpoint was damaged: an error naming it, not a traceback."""
    import dlm.data.prepare as prep

    src = text_files(tmp_path / "src", 3, 600)
    dest = tmp_path / "out"
    real = prep._save_state
    calls = [0]

    def die_after_first(path, state, pending):
        real(path, state, pending)
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # interrupted after the first file's checkpoint

    mp = pytest.MonkeyPatch()
    mp.setattr(prep, "_save_state", die_after_first)
    try:
        assert main(prepare_args(src, dest, tok_dir, "--chunk-size", "64")) == 130
    finally:
        mp.undo()
    state = dest / ".dlm-prepare-train" / "p0.state"
    truncate(state, 0.3)
    capsys.readouterr()
    assert main(prepare_args(src, dest, tok_dir, "--chunk-size", "64")) == 2
    one_line_error(capsys, str(state))


# ============================================================================================ damaged model folders
@pytest.fixture(scope="module")
def model_dirs(reference):
    """The reference run's final model (written by dlm train, with checksums.sha256) and a gated-LoRA folder."""
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.model.lora import prepare_model_for_lora
    from dlm.testing import save_tiny

    ref_out, _ = reference
    root = ref_out.parent / "models"
    root.mkdir(exist_ok=True)
    dlm = convert_ar_to_dlm(save_tiny(root / "base"), "idlm", block_size=2)
    prepare_model_for_lora(dlm, {"r": 2, "alpha": 4, "gated": True})
    dlm.save_pretrained(root / "gated")
    return ref_out, root / "gated"


def _model_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "train_log.jsonl"))
    return dst


@pytest.mark.parametrize(
    "damage",
    [
        "config_truncated",
        "config_flip",
        "weights_truncated",
        "weights_header_flip",
        "weights_payload_flip",
        "adapter_truncated",
        "adapter_header_flip",
        "tokenizer_truncated",
    ],
)
def test_damaged_model_folder_is_a_clear_error_naming_the_file(model_dirs, tmp_path, capsys, damage):
    trained, gated = model_dirs
    folder = _model_copy(gated if damage.startswith("adapter") else trained, tmp_path / "m")
    name = {
        "config": "config.json",
        "weights": "model.safetensors",
        "adapter": "dlm_adapter.safetensors",
        "tokenizer": "tokenizer.json",
    }[damage.split("_")[0]]
    f = folder / name
    if damage.endswith("truncated"):
        truncate(f)
    elif damage.endswith("header_flip"):
        flip_byte(f, f.read_bytes().index(b'"shape":[') + 9)  # a digit of the first tensor's shape
    elif damage == "config_flip":
        f.write_text(f.read_text().replace('"', "'", 1))
    else:
        flip_byte(f, f.stat().st_size - 64)  # inside the weights: only the checksums can tell
    capsys.readouterr()
    rc = main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--decode", "ar"])
    assert rc == 2
    line = one_line_error(capsys, name)
    assert str(folder) in line


# ============================================================================================ SIGKILL mid-save
def writing(ck: Path) -> bool:
    """A checkpoint write in progress: a temporary folder, or a step folder without its checksum list yet."""
    if not ck.is_dir():
        return False
    return any(p.name.startswith(".step_") or not (p / "checksums.sha256").is_file() for p in ck.iterdir())


@pytest.mark.slow
def test_sigkill_at_random_moments_of_checkpoint_writes(tiny_run, tmp_path):
    """At least 20 kills, each at a random moment while a checkpoint is being written (a run that saves every
    step, killed a random time after its newest temporary folder appears): ``--resume auto`` always finds the
    last complete checkpoint and the losses continue exactly those of an uninterrupted run."""
    steps = 40
    args = lambda out, *x: [sys.executable, "-m", "dlm", *train_args(tiny_run, out, steps, *x)]  # noqa: E731
    ref = tmp_path / "ref"
    r = subprocess.run([*args(ref), "--save-every", "1"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    full = losses(ref)
    out = tmp_path / "cut"
    rng = random.Random(29)
    kills, mid_save = 0, 0
    seen: dict[int, tuple] = {}
    resume = False
    while kills < 20:
        cmd = [*args(out, *(["--resume", "auto"] if resume else [])), "--save-every", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ck = out / "checkpoints"
        deadline = time.time() + 300
        target_wait = rng.uniform(0.0, 0.25)
        try:
            while time.time() < deadline and proc.poll() is None:
                if writing(ck):  # a checkpoint is being written
                    time.sleep(target_wait)
                    mid_save += writing(ck)
                    break
                time.sleep(0.002)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode == 0:
            break  # finished before the next kill
        if proc.returncode != -signal.SIGKILL:  # it failed by itself: a resume that found a broken checkpoint
            pytest.fail(f"the run after {kills} kills failed: {proc.stderr.read().decode()[-1500:]}")
        resume = True
        from dlm.train.checkpoint import latest_checkpoint, list_checkpoints, read_state

        last = latest_checkpoint(ck)
        if last is not None:  # the newest complete checkpoint is whole: its files match their checksums
            from dlm.fsutil import verify_checksums

            assert verify_checksums(last, "checkpoint")
            assert all(read_state(p)["step"] >= 1 for p in list_checkpoints(ck))
        if (out / "train_log.jsonl").exists():
            seen.update(losses(out))
    r = subprocess.run(
        [*args(out, "--resume", "auto"), "--save-every", "1"], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-2000:]
    seen.update(losses(out))
    assert kills >= 20 and mid_save >= 10, (kills, mid_save)
    assert sorted(seen) == list(range(1, steps + 1))
    for s in seen:
        assert seen[s] == full[s], s  # every step after every resume: the uninterrupted run's numbers
