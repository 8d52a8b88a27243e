"""The lm-evaluation-harness adapter: a harness task over a tiny local JSONL gives our own scores."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")

from dlm.eval.multiple_choice import evaluate_multiple_choice  # noqa: E402
from dlm.eval.scoring import as_eval_model, encode_pair, loglikelihoods  # noqa: E402
from dlm.eval.tasks.base import MCExample  # noqa: E402

ITEMS = [
    ("How do you boil an egg?", "Put it in boiling water.", "Put it in the fridge.", 0),
    ("How do you open a jar?", "Sing to it.", "Twist the lid.", 1),
    ("How do you dry a towel?", "Hang it in the sun.", "Soak it in water.", 0),
    ("How do you light a room?", "Close the curtains.", "Switch on the lamp.", 1),
]


def _write_task(folder):
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps({"goal": g, "sol1": a, "sol2": b, "label": y}) + "\n" for g, a, b, y in ITEMS))
    (folder / "tiny_mc.yaml").write_text(f"""task: dlm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{goal}}}}\\nAnswer: "
target_delimiter: ""
doc_to_choice: "{{{{[' ' + sol1, ' ' + sol2]}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return folder


def test_harness_runs_dlm_model_on_local_task(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dlm.eval.lm_eval  # noqa: F401  (registers "dlm")

    model_dir = tiny_model_dir("llama")
    tasks_dir = _write_task(tmp_path / "tasks_dir")
    out = lm_eval.simple_evaluate(
        model="dlm",
        model_args=f"pretrained={model_dir}",
        tasks=["dlm_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        batch_size=2,
    )
    got = out["results"]["dlm_tiny_mc"]
    # our own evaluation of the same items and prompt gives the same numbers
    from dlm.model.hub import load_model, load_tokenizer

    em = as_eval_model(load_model(model_dir), load_tokenizer(model_dir))
    examples = [MCExample(f"Question: {g}\nAnswer: ", [" " + a, " " + b], y) for g, a, b, y in ITEMS]
    ours = evaluate_multiple_choice(em, examples)
    assert got["acc,none"] == ours["acc"]
    assert got["acc_norm,none"] == ours["acc_norm"]


def test_adapter_rolling_and_generate(tiny_model_dir):
    from dlm.eval.lm_eval import DLMHarnessModel
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.testing import make_model, make_tokenizer

    lm = DLMHarnessModel(pretrained=str(tiny_model_dir("llama")))
    text = "The quick brown fox jumps over the lazy dog."
    (rolling,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    pairs = [([lm.em.prefix_token_id], lm.em.tokenizer(text, add_special_tokens=False)["input_ids"])]
    assert rolling == pytest.approx(loglikelihoods(lm.em, pairs)[0][0], abs=1e-4)
    ((ll, greedy),) = lm.loglikelihood([SimpleNamespace(args=("The quick brown", " fox"))])
    assert ll == pytest.approx(loglikelihoods(lm.em, [encode_pair(lm.em, "The quick brown", " fox")])[0][0])
    outs = lm.generate_until([SimpleNamespace(args=("Question: How", {"until": ["\n"], "max_gen_toks": 6}))])
    assert isinstance(outs[0], str) and "\n" not in outs[0]
    # a diffusion model through the adapter: loglikelihood = minus the denoising score, deterministic
    dlm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=make_tokenizer())
    dlm_lm = DLMHarnessModel(pretrained=dlm, diffusion_steps=4)
    reqs = [SimpleNamespace(args=("Question: How do you boil an egg?\nAnswer:", c)) for c in (" Boil it.", " No.")]
    first = dlm_lm.loglikelihood(reqs)
    assert first == dlm_lm.loglikelihood(reqs) and all(v < 0 for v, _ in first)


@pytest.mark.filterwarnings("ignore::dlm.deprecations.DLMDeprecationWarning")  # the old model_args, meant
def test_adapter_decoder_settings_from_model_args():
    """model_args are strings: the generation decoder and its settings by config field name, parsed by type; the
    old names (decode, gen_steps, token_budget) still read; a config object in Python."""
    from dlm.decode.configs import BlockConfig, MDMConfig
    from dlm.errors import DLMError
    from dlm.eval.lm_eval import DLMHarnessModel
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.testing import make_model, make_tokenizer

    dlm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=make_tokenizer())
    assert DLMHarnessModel(pretrained=dlm).decoder == MDMConfig()  # auto: the model's own
    lm = DLMHarnessModel(
        pretrained=dlm, decoder="mdm", steps="4", sampler="random", score_batch_tokens="512", diffusion_steps="8"
    )
    assert lm.decoder == MDMConfig(steps=4, sampler="random") and lm.settings.score_batch_tokens == 512
    assert lm.settings.diffusion_steps == 8 and lm.settings.batch_size == 8  # the EvalSettings of dlm eval
    with pytest.raises(DLMError, match="model_args seed must be an integer"):
        DLMHarnessModel(pretrained=dlm, seed="x")
    with pytest.warns(DeprecationWarning, match="model_args gen_steps is deprecated"):
        old = DLMHarnessModel(pretrained=dlm, decode="mdm", gen_steps="6", token_budget="256")
    assert old.decoder == MDMConfig(steps=6) and old.settings.score_batch_tokens == 256
    assert DLMHarnessModel(pretrained=dlm, decoder=MDMConfig(steps=3)).decoder.steps == 3
    with pytest.raises(DLMError, match="--decode block needs a diffusion LM|block-diffusion"):
        DLMHarnessModel(pretrained=make_model("llama"), tokenizer=make_tokenizer(), decoder=BlockConfig())


@pytest.mark.slow
def test_dlm_lm_eval_command_line(tiny_model_dir, tmp_path):
    tasks_dir = _write_task(tmp_path / "tasks_dir")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlm.eval.lm_eval",
            "--model",
            "dlm",
            "--model_args",
            f"pretrained={tiny_model_dir('llama')}",
            "--tasks",
            "dlm_tiny_mc",
            "--include_path",
            str(tasks_dir),
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dlm_tiny_mc" in proc.stdout
