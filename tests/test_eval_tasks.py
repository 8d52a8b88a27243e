"""Task loaders: layouts chosen by content, prompts as docs/algorithms.md#evaluation, and clear errors on bad input."""

import json
import shutil

import pytest
from task_data import COUNTS, FIRST

from dlm.errors import DLMError
from dlm.eval.tasks import TASKS, hellaswag, lambada, load_task, parse_task_list, piqa, poem_reverse, siqa, winogrande


def _lines(path):
    return [ln.strip() for ln in open(path) if ln.strip()]


def test_every_task_loads_its_release_layout(task_data):
    """The files tests/task_data.py writes, in each release's layout: counts, labels and the prompts built."""
    for name, n in COUNTS.items():
        assert len(load_task(name, task_data)) == n, name
    p = load_task("piqa", task_data)
    assert [e.label for e in p] == [int(x) for x in _lines(f"{task_data}/piqa/valid-labels.lst")]
    assert p[0].context == f"Question: {FIRST['piqa']['goal']}\nAnswer: " and p[0].label == 0
    assert p[0].choices == [" " + FIRST["piqa"]["sol1"], " " + FIRST["piqa"]["sol2"]]
    s = load_task("siqa", task_data)
    assert [e.label for e in s] == [int(x) - 1 for x in _lines(f"{task_data}/siqa/dev-labels.lst")]
    assert s[0].context == (
        "Question: Jordan lent Casey a coat before the long walk home. What will Casey want to do next?\nAnswer: "
    )
    assert s[0].choices[0] == "give the coat back later" and s[0].label == 0
    w = load_task("winogrande", task_data)
    assert [e.label for e in w] == [int(x) - 1 for x in _lines(f"{task_data}/winogrande/dev-labels.lst")]
    assert w[0].context == "Anna asked Beth for help with the essay because "
    assert w[0].choices == ["Anna was the better writer.", "Beth was the better writer."] and w[0].label == 1
    h = load_task("hellaswag", task_data)
    assert h[0].label == 2 and h[0].context == FIRST["hellaswag"]["context"]
    assert h[0].choices[2] == " shapes the dough into a round loaf."


def test_real_slices_load_every_task(real_data):
    """The optional real slices (../shared/data): the same loaders on the releases' own first records."""
    shared_data = real_data
    counts = {"hellaswag": 200, "winogrande": 200, "piqa": 200, "siqa": 200, "lambada": 300, "poem_reverse": 100}
    for name, n in counts.items():
        assert len(load_task(name, shared_data)) == n, name
    p = load_task("piqa", shared_data)
    labels = [int(x) for x in _lines(f"{shared_data}/piqa/valid-labels.lst")]
    assert [e.label for e in p] == labels
    assert p[0].context.startswith("Question: How do I ready a guinea pig cage") and p[0].context.endswith("\nAnswer: ")
    assert p[0].choices[0].startswith(" Provide the guinea pig")
    s = load_task("siqa", shared_data)
    assert [e.label for e in s] == [int(x) - 1 for x in _lines(f"{shared_data}/siqa/dev-labels.lst")]
    assert s[0].context == (
        "Question: Tracy didn't go home that evening and resisted Riley's attacks. "
        "What does Tracy need to do before this?\nAnswer: "
    )
    w = load_task("winogrande", shared_data)
    assert [e.label for e in w] == [int(x) - 1 for x in _lines(f"{shared_data}/winogrande/dev-labels.lst")]
    assert w[0].context == "Sarah was a much better surgeon than Maria so "
    assert w[0].choices == ["Sarah always got the easier cases.", "Maria always got the easier cases."]
    h = load_task("hellaswag", shared_data)
    assert h[0].label == 3 and h[0].context == "Roof shingle removal: A man is sitting on a roof. he"
    assert h[0].choices[3] == " starts pulling up roofing on a roof."


def test_lambada_layouts(task_data):
    plain = load_task("lambada", task_data)  # folder with both layouts: the plain-text release wins
    assert plain[0].target == "sea" and plain[0].prompt.endswith("never again set sail on the")
    assert plain[0].prompt == FIRST["lambada"]["text"].rsplit(" ", 1)[0]
    oa = lambada.load(f"{task_data}/lambada/lambada_openai.jsonl")
    assert oa[0].target == "sea" and oa[0].prompt.endswith("he never again set sail on the")


def test_poem_directions(task_data):
    ftb = poem_reverse.load(f"{task_data}/poem_reverse", direction="ftb")
    btf = poem_reverse.load(f"{task_data}/poem_reverse", direction="btf")
    assert ftb[0].target == "疑是地上霜" and ftb[0].prompt.startswith("床前明月光")
    assert btf[0].target == "床前明月光" and btf[0].prompt.startswith("疑是地上霜")
    assert ftb[0].max_new_tokens == 28
    with pytest.raises(DLMError, match="--poem-direction"):
        poem_reverse.load(f"{task_data}/poem_reverse", direction="sideways")


def test_layout_by_content_not_name(task_data, tmp_path):
    shutil.copy(f"{task_data}/piqa/valid.jsonl", tmp_path / "weird_name.txt")
    shutil.copy(f"{task_data}/piqa/valid-labels.lst", tmp_path / "answers.lst")
    ex = piqa.load(tmp_path)
    labels = [int(x) for x in _lines(f"{task_data}/piqa/valid-labels.lst")]
    assert len(ex) == COUNTS["piqa"] and [e.label for e in ex] == labels
    # the same folder is not SIQA / WinoGrande data: the message names the expected fields
    with pytest.raises(DLMError, match="context, question, answerA"):
        siqa.load(tmp_path)


def test_original_winogrande_and_mosaicml_agree(tmp_path):
    orig = tmp_path / "orig"
    orig.mkdir()
    (orig / "dev.jsonl").write_text(
        json.dumps(
            {
                "sentence": "The cup fell off the table because _ was wobbly.",
                "option1": "the cup",
                "option2": "the table",
                "answer": "2",
            }
        )
        + "\n"
    )
    ex = winogrande.load(orig)[0]
    assert ex.context == "The cup fell off the table because " and ex.label == 1
    assert ex.choices == ["the cup was wobbly.", "the table was wobbly."]
    mosaic = tmp_path / "mosaic"
    mosaic.mkdir()
    (mosaic / "w.jsonl").write_text(
        json.dumps({"context_options": ["A beat B so A", "A beat B so B"], "continuation": "won the cup.", "gold": 0})
        + "\n"
    )
    m = winogrande.load(mosaic)[0]
    assert (m.context, m.choices, m.label) == ("A beat B so ", ["A won the cup.", "B won the cup."], 0)
    # test split without answers takes the labels file beside it
    test = tmp_path / "test"
    test.mkdir()
    (test / "test.jsonl").write_text(
        json.dumps({"sentence": "X _ y.", "option1": "a", "option2": "b", "answer": ""}) + "\n"
    )
    with pytest.raises(DLMError, match="no answer"):
        winogrande.load(test)
    (test / "test-labels.lst").write_text("1\n")
    assert winogrande.load(test)[0].label == 0


def test_hellaswag_original_jsonl(tmp_path):
    rec = {
        "ind": 7,
        "activity_label": "Making a cake",
        "ctx_a": "A woman mixes flour.",
        "ctx_b": "she",
        "ctx": "A woman mixes flour. she",
        "endings": ["bakes it [title] well.", "sings.", "x", "y"],
        "label": 0,
    }
    (tmp_path / "hellaswag_val.jsonl").write_text(json.dumps(rec) + "\n")
    ex = hellaswag.load(tmp_path)[0]
    assert ex.context == "Making a cake: A woman mixes flour. She"
    assert ex.choices[0] == " bakes it. well." and ex.label == 0 and ex.id == "7"


def test_bad_inputs(tmp_path):
    with pytest.raises(DLMError, match="does not exist"):
        piqa.load(tmp_path / "missing.jsonl")
    unknown = tmp_path / "u.jsonl"
    unknown.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DLMError, match="expected JSONL records with fields goal, sol1, sol2"):
        piqa.load(unknown)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DLMError, match="empty"):
        piqa.load(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "valid.jsonl").write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
    (bad / "valid-labels.lst").write_text("2\n")
    with pytest.raises(DLMError, match="out of range for 2 choices"):
        piqa.load(bad)
    (bad / "valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(DLMError, match="2 labels but .* 1 records"):
        piqa.load(bad)
    (bad / "valid-labels.lst").unlink()
    with pytest.raises(DLMError, match="no labels file"):
        piqa.load(bad)
    with pytest.raises(DLMError, match="unknown eval task 'piqaa'"):
        parse_task_list("piqaa")
    with pytest.raises(DLMError, match=r"no data for task 'poem_reverse': pass --data-dir .* or --poem-path"):
        load_task("poem_reverse", None)
    with pytest.raises(DLMError, match=r"task 'piqa' has no local data, and from the hub: .*--data-dir .*--piqa-path"):
        load_task("piqa", None)  # offline here, nothing cached: the hub's line and the local flags
    assert set(TASKS) == {"hellaswag", "winogrande", "piqa", "siqa", "lambada", "poem_reverse", "isd_acceptance"}
