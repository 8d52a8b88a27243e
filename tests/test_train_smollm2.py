"""The real default model through the CPU preset (slow: smollm2-135m on CPU)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_idlm_b2_cpu_preset_trains_smollm2_and_saves_a_loadable_dlm(tmp_path, smollm2_path):
    from dlm.config import load_config
    from dlm.model.convert import AutoDLMForCausalLM
    from dlm.train.loop import train

    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {i} + {i}?"},
                            {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
                        ]
                    }
                )
                + "\n"
            )
    out = tmp_path / "b2"
    cfg = load_config(
        ROOT / "configs/idlm_b2_cpu.yaml",
        {
            "data": str(data),
            "output_dir": str(out),
            "max_train_steps": 3,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "cutoff_len": 96,
            "train.save_every": 3,
            "eval.eval_every": 3,
            "train.progress": False,
        },
    )
    result = train(cfg)
    assert result.step == 3 and all(x == x for x in result.losses)
    dlm = AutoDLMForCausalLM.from_pretrained(out)
    assert dlm.objective == "idlm" and dlm.block_size == 2
    assert dlm.tokenizer.convert_tokens_to_ids(dlm.tokenizer.mask_token) == dlm.mask_token_id
    hist = json.loads((out / "eval_history.jsonl").read_text().splitlines()[-1])
    assert hist["metrics"]["heldout_loss"] > 0
