"""Distributed for real: 2 CPU processes (gloo) launched with torchrun."""

import json
import os
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two(tmp_path, out, *extra, env=None) -> subprocess.CompletedProcess:
    """`dlm train` in 2 gloo processes on a tiny model and chat data."""
    from dlm.testing import save_tiny

    model = save_tiny(tmp_path / "tiny")
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(48):
            f.write(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i + 1} {i + 2}"}) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "dlm",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--objective",
        "idlm",
        "--block-size",
        "2",
        "--seq-length",
        "48",
        "--batch-size",
        "2",
        "--output-dir",
        str(out),
        "--train.progress",
        "false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.integration
def test_two_gloo_processes_read_different_data_and_stay_identical(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "ddp"
    r = launch_two(
        tmp_path,
        out,
        *("--gradient-accumulate-every", "2", "--max-train-steps", "4", "--learning-rate", "1e-3", "--save-every", "2"),
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert recs[0]["event"] == "start" and recs[0]["world_size"] == 2
    assert recs[0]["mixed_precision_by_rank"] == ["no", "no"]
    steps = [x for x in recs if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    for x in steps:  # each rank drew a different batch at every step
        a, b = x["data_fingerprint"]
        assert a != b
    end = recs[-1]
    assert end["event"] == "end"
    c0, c1 = end["param_checksum"]
    assert c0 == c1  # replicas identical after 4 synchronized AdamW steps
    # both ranks wrote their own data position into the checkpoint; the positions are per rank
    ck = out / "checkpoints" / "step_00000004" / "training_state"
    assert (ck / "dlm_rank0.pt").is_file() and (ck / "dlm_rank1.pt").is_file()
    import torch

    s0 = torch.load(ck / "dlm_rank0.pt", weights_only=False)["data"]
    s1 = torch.load(ck / "dlm_rank1.pt", weights_only=False)["data"]
    assert (s0["rank"], s1["rank"], s0["world_size"]) == (0, 1, 2)
    assert load_file(out / "model.safetensors")  # the final model was written once, by rank 0


@pytest.mark.integration
def test_replicas_train_at_the_main_processs_precision_when_their_measurements_differ(tmp_path):
    """mixed_precision auto measures in every process; a replica whose own verdict differs (another cache, a busy
    core) must still train at the main process's precision."""
    site = tmp_path / "site"
    site.mkdir()
    # rank 0 finds bf16 faster, rank 1 does not
    (site / "sitecustomize.py").write_text(
        "import os\nos.environ['DLM_CPU_BF16'] = '1' if os.environ.get('LOCAL_RANK') == '0' else '0'\n"
    )
    out = tmp_path / "ddp"
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    r = launch_two(tmp_path, out, "--max-train-steps", "1", env={"PYTHONPATH": pythonpath})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    start = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
    assert start["mixed_precision"] == "bf16" and "DLM_CPU_BF16=1" in start["mixed_precision_why"]
    assert start["mixed_precision_by_rank"] == ["bf16", "bf16"]


def test_rank_split_of_chat_batches_is_disjoint_and_covers_the_epoch():
    from dlm.data.sft import SFTCollator
    from dlm.train.data import SFTBatches

    examples = [{"input_ids": [i, i], "labels": [i, i], "index": i} for i in range(10)]
    col = SFTCollator(pad_token_id=0)
    seen = []
    for rank in range(2):
        it = SFTBatches(examples, 2, col, rank=rank, world_size=2, seed=3)
        seen.append([int(i) for _ in range(it.batches_per_epoch) for i in next(it)["index"]])
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == len(seen[1]) == 4  # 5 each, the incomplete batch dropped on both ranks


def test_chat_batches_resume_exactly():
    from dlm.data.sft import SFTCollator
    from dlm.train.data import SFTBatches

    examples = [{"input_ids": [i], "labels": [i], "index": i} for i in range(7)]
    col = SFTCollator(pad_token_id=0)
    a = SFTBatches(examples, 2, col, seed=5)
    for _ in range(5):  # crosses an epoch boundary (3 batches per epoch)
        next(a)
    b = SFTBatches(examples, 2, col, seed=5)
    b.load_state_dict(a.state_dict())
    assert [next(a)["index"].tolist() for _ in range(6)] == [next(b)["index"].tolist() for _ in range(6)]
