"""The renoise objective (uniform-noise block diffusion, DiffusionGemma) against a reference written here from the
family's definition on transformers' own DiffusionGemma forward: canvas by canvas, the decoder on the noisy
canvas over the encoder's cache of the clean context, self-conditioned on a first pass, plus the encoder's causal
loss; and its random draws in distribution."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dlm.model.families.diffusion_gemma import wrap
from dlm.objectives import get_objective
from dlm.objectives.base import IGNORE, prepare_batch
from dlm.testing import make_diffusion_gemma

pytest.importorskip("transformers.models.diffusion_gemma")

C = 4  # canvas length of the tiny checkpoint


@pytest.fixture(scope="module")
def pair():
    hf = make_diffusion_gemma(seed=4, window=5, canvas=C)
    return hf, wrap(hf)


def _batch(prompts: list[int], responses: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    L = max(p + r for p, r in zip(prompts, responses))
    ids = torch.randint(4, 300, (len(prompts), L), generator=g)
    labels = ids.clone()
    attn = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        labels[i, :p] = IGNORE
        labels[i, p + r :] = IGNORE
        attn[i, : p + r] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attn}


def _reference(hf, batch, t, x_t, sc, weighting="constant", encoder_weight=1.0, clip=None):
    """The loss by the family's definition, with transformers' forward: per sequence and canvas."""
    cap = hf.config.text_config.final_logit_softcapping
    per_seq, enc_ce, enc_n = [], 0.0, 0
    for i in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][i], batch["labels"][i]
        n = int(batch["attention_mask"][i].sum())
        p = int((labels[:n] == IGNORE).sum())
        ces = []
        for s in range(p, n, C):
            e = min(s + C, n)
            ctx, noisy = ids[None, :s], x_t[i, None, s:e]
            sc_logits = None
            if sc[i]:
                with torch.no_grad():
                    sc_logits = hf(input_ids=ctx, decoder_input_ids=noisy).logits
            logits = hf(input_ids=ctx, decoder_input_ids=noisy, self_conditioning_logits=sc_logits).logits
            ces.append(F.cross_entropy(logits[0].float(), ids[s:e], reduction="none"))
        w = 1.0 if weighting == "constant" else 1.0 / (1.0 - float(t[i]))
        if clip is not None:
            w = min(w, clip)
        per_seq.append(w * torch.cat(ces).mean())
        h = hf.model.encoder(input_ids=ids[None, :n]).last_hidden_state
        logp = (torch.tanh(hf.lm_head(h).float() / cap) * cap)[0]
        enc_ce = enc_ce + F.cross_entropy(logp[p - 1 : n - 1], ids[p:n], reduction="sum")
        enc_n += n - p
    return torch.stack(per_seq).mean() + encoder_weight * enc_ce / enc_n


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"weighting": "reweighted", "weight_clip": 3.0, "encoder_weight": 0.3},
        {"weighting": "reweighted", "encoder_weight": 0.0},
    ],
    ids=["default", "reweighted+clip", "no-encoder"],
)
def test_loss_equals_the_reference_on_a_fixed_batch(pair, settings):
    hf, dlm = pair
    batch = _batch([3, 6], [9, 4])  # several canvases and a short last one; a padded row; prompts past the window
    objective = get_objective("renoise", **settings)
    b = prepare_batch(batch, dlm.device)
    g = torch.Generator().manual_seed(1)
    t = torch.tensor([0.3, 0.8])
    x_t = torch.where(torch.rand(b.shape, generator=g) < 0.5, torch.randint(4, 300, b.shape, generator=g), b.input_ids)
    sc = torch.tensor([True, False])
    got = objective.loss(dlm, b, t, x_t, sc).loss
    want = _reference(
        hf,
        batch,
        t,
        x_t,
        sc,
        settings.get("weighting", "constant"),
        settings.get("encoder_weight", 1.0),
        settings.get("weight_clip"),
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gradients_equal_the_reference(pair):
    hf, dlm = pair
    batch = _batch([2], [7])
    objective = get_objective("renoise")
    b = prepare_batch(batch, dlm.device)
    t, sc = torch.tensor([0.5]), torch.tensor([True])
    x_t = b.input_ids.clone()
    x_t[0, 3:6] = torch.tensor([7, 8, 9])
    hf.zero_grad()
    objective.loss(dlm, b, t, x_t, sc).loss.backward()
    ours = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad()
    _reference(hf, batch, t, x_t, sc).backward()
    theirs = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad()
    assert set(ours) == set(theirs)
    for n in ours:  # float32 rounding of sums taken in another order: relative to the gradient's size
        scale = float(theirs[n].abs().max())
        torch.testing.assert_close(ours[n], theirs[n], rtol=0, atol=1e-5 * max(scale, 1e-3), msg=n)


def test_draws_noise_the_trained_tokens_at_the_sampled_level(pair):
    _, dlm = pair
    objective = get_objective("renoise", noise_min=0.2, noise_max=0.6, self_conditioning=0.25)
    batch = _batch([5] * 64, [40] * 64, seed=3)
    b = prepare_batch(batch, dlm.device)
    trainable = b.labels != IGNORE
    t, x_t, sc = objective.draw(b, trainable, 320, torch.Generator().manual_seed(0))
    assert bool(((t >= 0.2) & (t <= 0.6)).all()) and 0.3 < float(t.mean()) < 0.5
    assert bool((x_t[~trainable] == b.input_ids[~trainable]).all())  # the prompt is never noised
    changed = ((x_t != b.input_ids) & trainable).sum(1).float() / trainable.sum(1)
    # a replaced token is drawn uniformly (1 in 320 lands on the original): the changed share tracks t. Per row it
    # is Binomial(40, t) / 40 (sd <= 0.08): the mean over 64 rows within 0.04 (4 sd), and it follows t row by row
    assert abs(float(changed.mean() - (t * (1 - 1 / 320)).mean())) < 0.04
    assert float(torch.corrcoef(torch.stack([changed, t]))[0, 1]) > 0.5
    assert 5 <= int(sc.sum()) <= 28  # Binomial(64, 0.25): mean 16, sd 3.5


def test_a_training_step_lowers_the_loss(pair):
    hf, dlm = pair
    model = wrap(make_diffusion_gemma(seed=5, window=5, canvas=C))
    objective = get_objective("renoise", self_conditioning=0.5)
    batch = _batch([3, 3], [8, 8], seed=7)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(12):
        out = objective(model, batch, step=step, generator=torch.Generator().manual_seed(step % 2))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < losses[0] * 0.8, losses


def _chat(path, n=24):
    import json

    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"The answer is {2 * i}."}) + "\n")
    return path


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_dlm_train_fine_tunes_a_diffusion_gemma_folder_and_exports_it(tmp_path, lora):
    from transformers import DiffusionGemmaForBlockDiffusion

    from dlm.config import load_config
    from dlm.model.convert import load_any
    from dlm.model.export import export_model
    from dlm.testing import save_tiny_diffusion_gemma
    from dlm.train.loop import train

    folder = save_tiny_diffusion_gemma(tmp_path / "dg", seed=6)
    out = tmp_path / "run"
    over = {
        "model": str(folder),
        "objective": "renoise",
        "data": str(_chat(tmp_path / "chat.jsonl")),
        "output_dir": str(out),
        "seq_length": 48,
        "batch_size": 4,
        "max_train_steps": 3,
        "learning_rate": 1e-3,
        "train.progress": False,
    }
    if lora:
        over["lora_r"] = lora
    result = train(load_config(None, over))
    assert result.step == 3 and all(math.isfinite(x) for x in result.losses)
    tuned = load_any(out)
    assert tuned.objective == "renoise" and tuned.hf_config.dlm_family == "diffusion_gemma"
    before = make_diffusion_gemma(seed=6)
    moved = [n for n, p in tuned.base_model_hf.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert moved
    if lora:  # LoRA: the routed experts (3-D parameters, not linear layers) stay as they were
        assert not any(".experts." in n for n in moved)
    export_model(tuned, tmp_path / "export", "diffusion_gemma")
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "export").eval()
    ids, canvas = torch.tensor([[5, 9, 14, 20, 33, 40, 41]]), torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        want = theirs(input_ids=ids, decoder_input_ids=canvas).logits
        got = tuned.renoise(torch.cat([ids, canvas], 1), canvas_from=torch.tensor([7])).logits[:, 7:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_convert_turns_an_ar_model_into_a_renoising_one_that_trains_saves_and_decodes(tmp_path):
    from dlm.config import load_config
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import convert_ar_to_dlm, load_any
    from dlm.testing import make_model, save_tiny
    from dlm.train.loop import train

    ar_dir = save_tiny(tmp_path / "ar", "qwen3")
    dlm = convert_ar_to_dlm(ar_dir, "renoise", block_size=4)
    assert dlm.objective == "renoise" and dlm.mask_token_id is None and dlm.block_size == 4
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():  # context tokens are the AR model's own (the self-conditioning block touches canvases)
        torch.testing.assert_close(dlm(ids).logits, make_model("qwen3")(ids).logits, rtol=0, atol=1e-5)
    out = tmp_path / "run"
    over = {
        "model": str(ar_dir),
        "objective": "renoise",
        "block_size": 4,
        "data": str(_chat(tmp_path / "chat.jsonl")),
        "output_dir": str(out),
        "seq_length": 48,
        "batch_size": 4,
        "max_train_steps": 6,
        "learning_rate": 3e-3,
        "train.progress": False,
    }
    result = train(load_config(None, over))
    assert result.losses[-1] < result.losses[0]
    tuned = load_any(out)
    assert type(tuned.renoise).__name__ == "ConvertedRenoiseLM"
    sc = tuned.renoise.self_conditioning
    assert float(sc.down_proj.weight.detach().abs().sum()) > 0  # the new block trained (it starts at zero)
    params = SamplingParams(max_new_tokens=9, seed=0)
    first = Engine(tuned, tuned.tokenizer, decoder="renoise", steps=3).generate([[5, 6, 7]], params)[0]
    again = Engine(load_any(out), None, decoder="renoise", steps=3).generate([[5, 6, 7]], params)[0]
    assert len(first.token_ids) == 9 and first.token_ids == again.token_ids


def test_the_commands_convert_decode_and_refuse_to_export_a_converted_model(tmp_path, capsys):
    """`dlm convert --objective renoise` writes the folder and says it has no mask token; `dlm generate` on it picks
    --decode renoise by itself; --format diffusion_gemma refuses a model whose layers are not DiffusionGemma's."""
    from dlm.cli import main
    from dlm.testing import save_tiny

    ar = save_tiny(tmp_path / "ar", "qwen2")
    out = tmp_path / "rn"
    assert (
        main(["convert", "--model", str(ar), "--objective", "renoise", "--block-size", "4", "--output", str(out)]) == 0
    )
    assert (
        "objective=renoise block_size=4" in capsys.readouterr().out
        and (out / "dlm_self_conditioning.safetensors").is_file()
    )
    argv = ["generate", "--model", str(out), "--prompt", "The cat", "--max-new-tokens", "6", "--steps", "2", "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["decode"] == "renoise" and rec["steps_per_canvas"] == [2, 2] and len(rec["token_ids"]) == 6
    assert main(["export", "--model", str(out), "--format", "diffusion_gemma", "--output", str(tmp_path / "x")]) == 2
    assert "a 'renoise' model of qwen2" in capsys.readouterr().err and not (tmp_path / "x").exists()
