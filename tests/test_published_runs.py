"""Published checkpoints through the rest of dlm: an I-DLM in the SDAR format decodes with ISD at its stride and
its greedy output is the same model's greedy AR output; a LLaDA checkpoint is scored by `dlm eval`'s denoising
score with LLaDA's conventions (bidirectional, no shift); Dream and LLaDA checkpoints are served batched."""

import json

import pytest
import torch
import torch.nn.functional as F
from published_layouts import MASK, write_dream, write_idlm, write_llada, write_llada2, write_llada_moe

import dlm
from dlm.cli import main
from dlm.decode import generate
from dlm.decode.configs import ISDConfig
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30]]


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_idlm_checkpoint_isd_at_its_stride_equals_greedy_ar(tmp_path, block_size):
    model = dlm.load_model(write_idlm(tmp_path / "idlm", seed=block_size, block_size=block_size))
    assert model.objective == "idlm" and model.is_causal
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = generate(model, PROMPTS, "ar", p, options=EngineOptions(max_batch_size=3))
    # drafting at every step at the default stride, the model's block size + 1: drafts at N - 1 = block_size positions
    isd = generate(model, PROMPTS, ISDConfig(draft_budget="always"), p, options=EngineOptions(max_batch_size=3))
    for a, b in zip(ar, isd):
        assert b.token_ids == a.token_ids and len(a.token_ids) == 12
        assert len(b.stats.proposed) == block_size
    # the default ('auto': AR steps or drafting at a stride it chooses up to that one): the same tokens
    auto = generate(model, PROMPTS, "isd", p, options=EngineOptions(max_batch_size=3))
    assert [b.token_ids for b in auto] == [a.token_ids for a in ar]
    assert all(len(b.stats.proposed) <= block_size for b in auto)
    # the AR reference itself: the causal forward of the loaded model, one token at a time
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(12):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            logits[MASK] = float("-inf")
            ids.append(int(logits.argmax()))
    assert ar[0].token_ids == ids[len(PROMPTS[0]) :]


def test_llada2_fine_tuned_then_exported_to_its_own_layout(tmp_path):
    """A LLaDA2 checkpoint trains with dlm train (the block objective at its block size; the experts' weights
    move) and the result exports back to LLaDA2's layout, which loads to the trained model's logits."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}."},
            ]
        }
        for i in range(24)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    src = write_llada2(tmp_path / "llada2", block_size=8)
    out, exported = tmp_path / "tuned", tmp_path / "tuned-llada2"
    train = ["train", "--model", str(src), "--data", str(tmp_path / "chat.jsonl")]  # its own objective: block
    train += ["--seq-length", "32"]
    train += ["--batch-size", "4", "--max-train-steps", "3", "--learning-rate", "1e-2", "--output-dir", str(out)]
    assert main([*train, "--train.progress", "false"]) == 0
    tuned = dlm.load_model(out)
    assert (tuned.objective, tuned.block_size, tuned.hf_config.dlm_family) == ("block", 8, "llada2")
    before = dlm.load_model(src).base_model_hf.model.layers[1].mlp.experts.gate_up_proj
    assert not torch.equal(tuned.base_model_hf.model.layers[1].mlp.experts.gate_up_proj, before)
    assert main(["export", "--model", str(out), "--format", "llada2", "--output", str(exported)]) == 0
    back = dlm.load_model(exported)
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, tuned(input_ids=ids).logits)


def test_idlm_checkpoint_through_dlm_generate(tmp_path, capsys):
    folder = write_idlm(tmp_path / "idlm", block_size=2)
    out = {}
    for decode in ("ar", "isd"):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(folder),
                    "--prompt",
                    "The cat sat",
                    "--decode",
                    decode,
                    "--max-new-tokens",
                    "10",
                    "--json",
                    "--threads",
                    "1",
                ]
            )
            == 0
        )
        out[decode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["isd"]["token_ids"] == out["ar"]["token_ids"] and out["isd"]["acceptance"]


def test_llada_denoising_score_uses_its_conventions(tmp_path):
    """The denoising score of a LLaDA checkpoint: masks drawn per step, a bidirectional forward, cross-entropy
    at the masked positions themselves (no shift)."""
    from dlm.eval.scoring import as_eval_model, denoising_scores, draw_masks

    model = dlm.load_model(write_llada(tmp_path / "llada", seed=2))
    em = as_eval_model(model)
    assert em.kind == "diffusion" and em.shift is False
    ctx, cont = [5, 6, 7, 8], [9, 10, 11]
    got = denoising_scores(em, [(ctx, cont)], keys=["k"], steps=4, seed=0)[0]
    masks = draw_masks(len(cont), 4, 0, "k")
    full = torch.tensor(ctx + cont)
    total = 0.0
    for k in range(4):
        where = masks[k].nonzero()[:, 0] + len(ctx)
        x = full.clone()
        x[where] = MASK
        with torch.no_grad():
            logits = model(input_ids=x[None]).logits[0].float()  # the family's (bidirectional) forward
        logits[:, MASK] = float("-inf")
        total += F.cross_entropy(logits[where], full[where]).item()
    assert got == pytest.approx(total / 4, rel=1e-4)


@pytest.mark.integration
def test_dlm_eval_scores_a_published_bidirectional_checkpoint(tmp_path, task_data, capsys):
    folder = write_llada(tmp_path / "llada")
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(folder),
                "--eval-tasks",
                "piqa",
                "--data-dir",
                task_data,
                "--limit",
                "3",
                "--diffusion-steps",
                "2",
                "--output",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())["results"]["piqa"]
    assert res["n"] == 3 and res["scoring"] == "diffusion"


@pytest.mark.integration
@pytest.mark.parametrize(
    "writer,decode,kw",
    [
        (write_llada, "mdm", dict(sampler="llada", steps=4, semi_ar_block=4)),
        (write_dream, "mdm", dict(sampler="dream", steps=4, alg="entropy")),
        (write_llada2, "block", dict(steps=4)),
        (write_llada_moe, "mdm", dict(sampler="llada", steps=4, semi_ar_block=4)),
    ],
)
def test_published_checkpoints_are_served(tmp_path, writer, decode, kw):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dlm.decode.configs import make_config
    from dlm.serve.app import ServerThread, ServeSettings, create_app, load_engine
    from dlm.serve.scheduler import Scheduler

    folder = writer(tmp_path / "ckpt")
    config = make_config(decode, **kw)
    eng = load_engine(str(folder), config, options=EngineOptions(threads=1, max_batch_size=3))
    prompts = [("The cat " * (i % 3 + 1), 3 + i) for i in range(5)]
    refs = [generate(eng.model, [eng.tokenizer(p)["input_ids"]], config, SamplingParams(m))[0] for p, m in prompts]
    app = create_app(Scheduler(eng), ServeSettings(model_name="tiny", max_tokens_limit=32))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for (p, m), ref in zip(prompts, refs):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0)
            assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
        # a suffix (fill-in-the-middle): what generate fills between the prompt and it; refused by a block server
        suffix = " sat on the mat."
        fill = SamplingParams(6, suffix_ids=tuple(eng.tokenizer(suffix, add_special_tokens=False)["input_ids"]))
        if decode == "mdm":
            ref = generate(eng.model, [eng.tokenizer("The cat")["input_ids"]], config, fill)[0]
            r = client.completions.create(model="tiny", prompt="The cat", suffix=suffix, max_tokens=6, temperature=0)
            assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
            plain = generate(eng.model, [eng.tokenizer("The cat")["input_ids"]], config, SamplingParams(6))[0]
            assert ref.token_ids != plain.token_ids
        else:
            with pytest.raises(openai.BadRequestError, match="suffix"):
                client.completions.create(model="tiny", prompt="The cat", suffix=suffix, max_tokens=6)
