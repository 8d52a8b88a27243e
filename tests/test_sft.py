import json

import pytest
import torch

from dlm.data.sft import IGNORE_INDEX, SFTCollator, load_sft_examples, read_jsonl, record_to_messages, tokenize_messages
from dlm.errors import DLMError

LAYOUTS = {
    "openai": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a cat."},
            {"role": "assistant", "content": "The cat."},
        ]
    },
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Name a cat."},
            {"from": "gpt", "value": "The cat."},
        ]
    },
    "prompt_response": {"system": "Be brief.", "prompt": "Name a cat.", "response": "The cat."},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_give_the_same_tokens_and_only_the_answer_is_trained(layout, tiny_tokenizer):
    msgs = record_to_messages(LAYOUTS[layout])
    ex = tokenize_messages(msgs, tiny_tokenizer)
    ref = tokenize_messages(record_to_messages(LAYOUTS["openai"]), tiny_tokenizer)
    assert ex == ref
    ids, labels = ex["input_ids"], ex["labels"]
    # the whole sequence is the chat template rendered once
    full = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tiny_tokenizer.decode(ids) == full
    trained = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    assert tiny_tokenizer.decode(trained) == "The cat.<|im_end|>\n"
    # the prompt part is exactly what inference feeds (generation prompt included)
    n_prompt = labels.index(next(lab for lab in labels if lab != IGNORE_INDEX))
    prompt = tiny_tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert tiny_tokenizer.decode(ids[:n_prompt]) == prompt


def test_multi_turn_trains_every_assistant_turn(tiny_tokenizer):
    msgs = record_to_messages(
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "gpt", "value": "one"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "two"},
            ]
        }
    )
    ex = tokenize_messages(msgs, tiny_tokenizer)
    trained = [i for i, lab in zip(ex["input_ids"], ex["labels"]) if lab != IGNORE_INDEX]
    assert tiny_tokenizer.decode(trained) == "one<|im_end|>\ntwo<|im_end|>\n"


def test_instruction_input_output_layout(tiny_tokenizer):
    msgs = record_to_messages({"instruction": "Add", "input": "1 2", "output": "3"})
    assert msgs == [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]


@pytest.mark.parametrize(
    "rec, msg",
    [
        ({"text": "hello"}, "expected 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": "hi"}, "list of"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown ShareGPT speaker"),
        ({"prompt": "a", "response": 3}, "must be a string"),
    ],
)
def test_bad_records_name_the_fields(rec, msg):
    with pytest.raises(DLMError, match=msg):
        record_to_messages(rec, where="f.jsonl:3")


def test_bad_json_names_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n\n{oops\n')
    with pytest.raises(DLMError, match=r"d\.jsonl:3"):
        read_jsonl(p)
    with pytest.raises(DLMError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_truncation_drops_records_without_answer_tokens(tmp_path, tiny_tokenizer):
    p = tmp_path / "d.jsonl"
    long_prompt = "word " * 200
    p.write_text(
        json.dumps({"prompt": long_prompt, "response": "x"})
        + "\n"
        + json.dumps({"prompt": "hi", "response": "there"})
        + "\n"
    )
    ex = load_sft_examples(p, tiny_tokenizer, max_length=32)
    assert [e["index"] for e in ex] == [2]
    assert all(len(e["input_ids"]) <= 32 for e in ex)
    with pytest.raises(DLMError, match="cutoff_len"):
        load_sft_examples(p, tiny_tokenizer, max_length=4)


def test_collator_pads_with_ignored_labels():
    col = SFTCollator(pad_token_id=3, pad_to_multiple_of=4)
    batch = col(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "index": 1},
            {"input_ids": [8, 9, 10, 11, 12], "labels": [-100, -100, 10, 11, 12], "index": 2},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 3, 3, 3, 3], [8, 9, 10, 11, 12, 3, 3, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7] + [-100] * 5, [-100, -100, 10, 11, 12] + [-100] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["index"].tolist() == [1, 2]
    assert batch["input_ids"].dtype == torch.long
