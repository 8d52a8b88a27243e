"""Structured outputs (``SamplingParams(structured=StructuredOutput(...))``): AR decoding equals a plain
teacher-forced loop that masks each position's logits by the grammar; ISD's greedy output equals it on every path
(drafts the grammar refuses, drafts verified under earlier drafts); sampled ISD has exactly the constrained AR
distribution; the request ends when the grammar is complete."""

import json
import math

import pytest
import torch

pytest.importorskip("llguidance")

from llguidance import LLMatcher  # noqa: E402

from dlm import convert_ar_to_dlm  # noqa: E402
from dlm.decode.engine import Engine  # noqa: E402
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams, token_logprobs  # noqa: E402
from dlm.decode.structured import Constraint, GrammarBook, StructuredOutput  # noqa: E402
from dlm.errors import DLMError  # noqa: E402
from dlm.testing import every_isd_path, make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = make_tokenizer()
SCHEMA = {  # keys out of alphabetical order: the output follows the schema's order
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["s", "n"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutput(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutput(json_object=True),
    "regex": StructuredOutput(regex=r"[0-9]{2,4} (cats|dogs)"),
    "choice": StructuredOutput(choice=("yes", "no", "the cat sat")),
    "grammar": StructuredOutput(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]/'),
}


def prompts():
    return [TOK(t, add_special_tokens=False)["input_ids"] for t in ("The cat", "Numbers: 1 2", "Once upon")]


def idlm(seed=1):
    return convert_ar_to_dlm(make_model("llama", seed=seed), "idlm", block_size=3, tokenizer=TOK)


def grammar_mask(matcher, vocab):
    """The allowed tokens by llguidance's byte-per-token API (not the bitmask the engine unpacks)."""
    return torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0


def reference_greedy(model, prompt, spec, max_new, stop_ids):
    """Greedy decoding by full forwards, each position's logits masked by a matcher that has seen the output."""
    book = GrammarBook(TOK, int(Engine(model).config.vocab_size), stop_ids)
    matcher = LLMatcher(book.lltok, spec.llguidance_grammar(), log_level=0)
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        logits[~grammar_mask(matcher, logits.shape[-1])] = float("-inf")
        logits[model.mask_token_id] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        if t in stop_ids:
            break
        assert matcher.consume_token(t)
        if matcher.is_stopped():
            break
    return out


@pytest.mark.parametrize("kind", list(SPECS))
def test_ar_and_every_isd_path_equal_the_constrained_reference(kind):
    model = idlm()
    spec = SPECS[kind]
    stop = Engine(model).default_stop
    ps = prompts()
    params = SamplingParams(24, structured=spec)
    ref = [reference_greedy(model, p, spec, 24, stop) for p in ps]
    free = [
        r.token_ids for r in Engine(model, options=EngineOptions(max_batch_size=3)).generate(ps, SamplingParams(24))
    ]
    assert ref != free  # the grammar changes the output, so a decoder that ignored it would fail
    ar = Engine(model, options=EngineOptions(max_batch_size=2)).generate(ps, params)
    assert [r.token_ids for r in ar] == ref
    if kind == "json":  # the schema's forced keys and punctuation verified in one forward (jump-forward)
        assert sum(len(r.token_ids) for r in ar) > 1.2 * sum(r.stats.forwards for r in ar)
    static = Engine(model, options=EngineOptions(max_batch_size=2, static_cache=True)).generate(ps, params)
    assert [r.token_ids for r in static] == ref
    long = [p + [5, 6, 7] * 6 for p in ps]  # over the prefix cache's 16-token minimum
    for decoder in ("ar", "isd"):  # a forced start fed after a prompt whose KV comes from the prefix cache
        eng = Engine(model, decoder=decoder, options=EngineOptions(max_batch_size=1, prefix_cache=4096))
        eng.generate(long, params)
        again = eng.generate([p + [8, 9] for p in long], params)  # the stored prompts' KV reused
        alone = Engine(model, decoder=decoder, options=EngineOptions(max_batch_size=1)).generate(
            [p + [8, 9] for p in long], params
        )
        assert [r.token_ids for r in again] == [r.token_ids for r in alone], decoder
        assert eng.prefix.hits >= 3 and all(r.stats.cached_tokens > 0 for r in again), decoder
    truth = {i: p + r for i, (p, r) in enumerate(zip(ps, ref))}
    for name, res in every_isd_path(model, ps, params, truth, max_batch_size=2):
        assert [r.token_ids for r in res] == ref, name
        if name in ("isd-n3", "isd-candidates") and min(len(r) for r in ref) >= 8:
            assert any(r.stats.tpf > 1.3 for r in res), name  # drafts accepted: later rows saw earlier drafts


def test_outputs_match_their_grammar_and_end_with_it():
    model = idlm()
    ps = prompts()
    for decoder, kw in [("ar", {}), ("isd", {"stride": 3})]:
        eng = Engine(model, decoder=decoder, options=EngineOptions(max_batch_size=3), **kw)
        for temperature in (0.0, 1.0):
            choice = eng.generate(ps, SamplingParams(16, temperature=temperature, seed=0, structured=SPECS["choice"]))
            for r in choice:
                assert r.text in ("yes", "no", "the cat sat") and r.finish_reason == "stop", r.text
                assert r.token_ids[-1] not in eng.default_stop  # ended by the grammar, without an EOS step
            js = eng.generate(ps, SamplingParams(48, temperature=temperature, seed=1, structured=SPECS["json"]))
            for r in js:
                assert r.finish_reason == "stop", r.text
                value = json.loads(r.text)
                assert list(value) == ["s", "n"] and isinstance(value["n"], int) and len(value["s"]) <= 6
            rx = eng.generate(ps, SamplingParams(16, temperature=temperature, seed=2, structured=SPECS["regex"]))
            for r in rx:
                digits, animal = r.text.split(" ")
                assert digits.isdigit() and 2 <= len(digits) <= 4 and animal in ("cats", "dogs"), r.text


def test_constraint_masks_each_position_under_its_own_history_and_rolls_back():
    book = GrammarBook(TOK, 330, [0])
    c = book.constraint(SPECS["choice"], [0])
    yes, no = (TOK(w, add_special_tokens=False)["input_ids"] for w in ("yes", "no"))
    c.add(yes[:1])
    before = c.allowed([[]])
    rows = c.allowed([[], yes[1:], [no[0]], yes[1:]])
    assert torch.equal(rows[0], before[0]) and torch.equal(rows[1], rows[3])
    assert rows[1].sum() == 1 and bool(rows[1][0])  # "yes" complete: only the end of the sequence
    assert bool(rows[2].all())  # after a refused token: never committed from, so nothing is masked
    assert torch.equal(c.allowed([[]])[0], before[0])  # rolled back
    assert not bool(rows[0][330 - 1])  # ids past the tokenizer's vocabulary are never allowed
    assert not c.done
    c.add(yes[1:])
    assert c.done
    with pytest.raises(RuntimeError, match="against the request's grammar"):
        book.constraint(SPECS["choice"], [0]).add(TOK("maybe", add_special_tokens=False)["input_ids"])


def small_idlm():
    model = make_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return convert_ar_to_dlm(model, "idlm", block_size=3, tokenizer=TOK)


def exact_distribution(model, prompt, spec, stop_ids):
    """The constrained model's exact distribution over whole outputs, by enumerating the grammar's token paths."""
    book = GrammarBook(TOK, int(Engine(model).config.vocab_size), stop_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(matcher, seq, logp):
        if matcher.is_stopped():
            out[tuple(seq)] = math.exp(logp)
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + seq])).logits[0, -1].float()
        allowed = grammar_mask(matcher, logits.shape[-1])
        allowed[model.mask_token_id] = False
        logits[~allowed] = float("-inf")
        lp = logits.log_softmax(-1)
        for t in allowed.nonzero().flatten().tolist():
            if t in stop_ids:  # the model ends an accepting grammar that may go on (kept in token_ids)
                out[tuple(seq + [t])] = math.exp(logp + float(lp[t]))
                continue
            m = matcher.deep_copy()
            assert m.consume_token(t)
            walk(m, seq + [t], logp + float(lp[t]))

    walk(LLMatcher(book.lltok, spec.llguidance_grammar(), log_level=0), [], 0.0)
    return out


def test_sampled_isd_has_the_constrained_ar_distribution():
    model = small_idlm()
    spec = StructuredOutput(regex=r"[xy][qz] cat[jw]k?")  # each position its own allowed set; forced " cat"
    prompt = TOK("The cat sat on", add_special_tokens=False)["input_ids"]
    stop = Engine(model).default_stop
    exact = exact_distribution(model, prompt, spec, stop)
    keys = sorted(exact)
    assert 8 <= len(keys) <= 40 and abs(sum(exact.values()) - 1) < 1e-5
    p = torch.tensor([exact[k] for k in keys])
    n = 2000
    eps = math.sqrt((len(keys) * math.log(2) + math.log(1e4)) / (2 * n))  # Bretagnolle-Huber-Carol, delta 1e-4
    assert float(p.max()) < 0.6  # not one outcome: the test sees the distribution
    for name, kw in [
        ("ar", dict(decoder="ar")),
        ("isd2", dict(decoder="isd", stride=2)),
        ("isd3", dict(decoder="isd", stride=3)),
        ("isd3-cold", dict(decoder="isd", stride=3, fallback="off")),  # cold starts after every rejection
    ]:
        res = Engine(model, options=EngineOptions(max_batch_size=n), **kw).generate(
            [prompt] * n, [SamplingParams(8, temperature=1.0, seed=s, structured=spec) for s in range(n)]
        )
        counts = torch.zeros(len(keys))
        for r in res:
            assert r.finish_reason == "stop", (name, r.text)
            counts[keys.index(tuple(r.token_ids))] += 1
        tv = 0.5 * float((counts / n - p).abs().sum())
        assert tv < eps, (name, tv, eps)
        # the forced " cat" verified with the pending token: more than a token a forward on average
        assert sum(len(r.token_ids) for r in res) > 1.1 * sum(r.stats.forwards for r in res), name
        if name != "ar":  # both outcomes of ISD's own verify were exercised
            accepted = sum(r.stats.accepted[0] for r in res)
            rejected = sum(r.stats.proposed[0] for r in res) - accepted
            assert accepted >= 5 and rejected >= 5, (name, accepted, rejected)


def test_logprobs_stay_the_models_own_under_a_grammar():
    model = idlm()
    ps = prompts()
    params = SamplingParams(12, logprobs=1, structured=SPECS["json"])
    for decoder, kw in [("ar", {}), ("isd", {"stride": 3})]:  # AR verifies forced tokens several at a step too
        r = Engine(model, decoder=decoder, **kw).generate([ps[0]], params)[0]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ps[0] + r.token_ids])).logits[0]
        want = token_logprobs(logits[len(ps[0]) - 1 : -1], r.token_ids, 1, model.mask_token_id)
        assert len(r.logprobs) == len(want) == len(r.token_ids)
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(r.logprobs, want)), decoder


def test_refusals():
    with pytest.raises(DLMError, match="exactly one of"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(DLMError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(DLMError, match="not valid JSON"):
        StructuredOutput(json="{nope")
    with pytest.raises(DLMError, match="non-empty strings"):
        StructuredOutput(choice=("a", ""))
    with pytest.raises(DLMError, match="structured must be"):
        SamplingParams(4, structured={"regex": "a"})
    assert SamplingParams(4, structured=SPECS["regex"]).adjusts
    model = idlm()
    eng = Engine(model)
    with pytest.raises(DLMError, match="regex of the structured output is invalid"):
        eng.add(prompts()[0], SamplingParams(4, structured=StructuredOutput(regex="(")))
    with pytest.raises(DLMError, match="grammar of the structured output is invalid"):
        eng.add(prompts()[0], SamplingParams(4, structured=StructuredOutput(grammar="start: nope")))
    mdm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=TOK)
    with pytest.raises(DLMError, match=r"penalties: not with --decode \w+.*use a left-to-right decoder"):
        Engine(mdm, decoder="mdm", steps=4).add(prompts()[0], SamplingParams(4, structured=SPECS["choice"]))
    bare = idlm()
    bare.tokenizer = None
    with pytest.raises(DLMError, match="need the model's tokenizer"):
        Engine(bare).add([5, 6], SamplingParams(4, structured=SPECS["choice"]))


def test_a_compiled_grammar_is_reused_not_shared():
    book = GrammarBook(TOK, 330, [0])
    a, b = book.constraint(SPECS["choice"], [0]), book.constraint(SPECS["choice"], [0])
    assert len(book._compiled) == 1 and a.matcher is not b.matcher
    a.add(TOK("no", add_special_tokens=False)["input_ids"])
    assert a.done and not b.done


@pytest.mark.slow
def test_structured_outputs_on_smollm2(smollm2_path, monkeypatch):
    """The real model under a JSON schema, chat template and all: every ISD path gives constrained AR's tokens, the
    records parse and follow the schema, and the schema's forced text lifts ISD's tokens per forward above 1 even
    with untrained masks."""
    from dlm.model.convert import load_any

    dlm = load_any(smollm2_path, "idlm", block_size=2)
    tok = dlm.tokenizer
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    asks = ["the capital of France", "the largest city of Japan", "a city in Brazil"]
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Give {a} and its population as JSON."}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )["input_ids"]
        for a in asks
    ]
    for compact in (True, False):
        params = SamplingParams(64, structured=StructuredOutput(json=schema, disable_any_whitespace=compact))
        ar = Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(prompts, params)
        for r in ar:
            assert r.finish_reason == "stop" and list(json.loads(r.text)) == ["city", "population"], r.text
        for kw in [dict(stride=2), dict(stride=3), dict(stride=3, fallback="off"), dict(candidates=3)]:
            res = Engine(dlm, decoder="isd", options=EngineOptions(max_batch_size=3), **kw).generate(prompts, params)
            assert [r.token_ids for r in res] == [r.token_ids for r in ar], kw
            if compact and "candidates" not in kw:  # against the masks' own drafts alone
                with monkeypatch.context() as m:
                    m.setattr(Constraint, "forced", lambda self, limit=0: [])
                    own = Engine(dlm, decoder="isd", options=EngineOptions(max_batch_size=3), **kw).generate(
                        prompts, params
                    )
                assert [r.token_ids for r in own] == [r.token_ids for r in ar], kw
                tpf = [sum(len(r.token_ids) for r in x) / sum(r.stats.forwards for r in x) for x in (res, own)]
                assert tpf[0] > tpf[1], (kw, tpf)


# ------------------------------------------------------------------------ a grammar after the reasoning block
OPEN, CLOSE = 318, 319


def think_tokenizer():
    """The tiny tokenizer with ``<think>`` and ``</think>`` one token each, as in Qwen3's vocabulary (a fresh one:
    converting a model adds its mask token to the tokenizer it is given)."""
    tok = make_tokenizer(318)
    tok.add_tokens(["<think>", "</think>"])
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [OPEN, CLOSE]
    return tok


def reference_after_thinking(model, tok, prompt, spec, max_new, stop_ids, bias, frequency_penalty=0.0):
    """Greedy by full forwards with ``bias`` added to the logits and ``frequency_penalty`` times each token's count
    in the output so far taken off; the grammar masks the answer from its start, or
    from after ``</think>`` where it opens with ``<think>`` (``after_thinking="tags"``) or the prompt opened one
    (``"open"``); the tags are not fed to the matcher."""
    vocab = bias.shape[0]
    book = GrammarBook(tok, vocab, stop_ids)
    matcher = LLMatcher(book.lltok, spec.llguidance_grammar(), log_level=0)
    state = "thinking" if spec.after_thinking == "open" else "start"
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float() + bias
        logits -= frequency_penalty * torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
        if state != "thinking":
            allowed = grammar_mask(matcher, vocab)
            if state == "start":
                allowed[OPEN] = True
            logits[~allowed] = float("-inf")
        logits[model.mask_token_id] = float("-inf")
        t = int(logits.argmax())
        out.append(t)
        if t in stop_ids:
            break
        if state == "start" and t == OPEN:
            state = "thinking"
            continue
        if state == "thinking":
            state = "grammar" if t == CLOSE else state
            continue
        state = "grammar"
        assert matcher.consume_token(t)
        if matcher.is_stopped():
            break
    return out


@pytest.mark.parametrize("mode", ["open", "tags"])
def test_a_grammar_after_the_reasoning_block_on_every_path(mode):
    """``after_thinking``: the reasoning is free, the grammar starts after ``</think>`` (and in ``"tags"`` mode at
    once where the answer does not open a block). AR and every ISD path - drafts that cross the closing tag
    verified under their own histories - equal the reference; the answer's text after the block parses."""
    tok = think_tokenizer()
    model = convert_ar_to_dlm(make_model("llama", seed=3), "idlm", block_size=3, tokenizer=tok)
    short = {  # closes within the token budget whatever a random model picks
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 3}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["s", "n"],
        "additionalProperties": False,
    }
    spec = StructuredOutput(json=short, disable_any_whitespace=True, after_thinking=mode)
    stop = Engine(model).default_stop
    vocab = int(Engine(model).config.vocab_size)  # the tokenizer's and the mask token
    ps = [tok(t, add_special_tokens=False)["input_ids"] for t in ("The cat", "Numbers: 1 2", "Once upon")]
    # a bias on the closing tag: the smallest with which every answer closes its block (some after thinking a
    # while) and completes its record; "tags": the opening tag biased to come first, and then kept from coming again
    # by a frequency penalty
    fp = 2.0 if mode == "tags" else 0.0
    ref = None
    b = 0.01
    while b < 6:
        bias = torch.zeros(vocab)
        bias[CLOSE] = b
        if mode == "tags":
            bias[OPEN] = 1.5
        ref = [reference_after_thinking(model, tok, p, spec, 64, stop, bias, fp) for p in ps]
        closes = [r.index(CLOSE) if CLOSE in r else 99 for r in ref]
        if max(closes) < 99 and max(closes) >= 3 and all(len(r) < 64 for r in ref):
            break
        b *= 1.3
    assert ref is not None and all(CLOSE in r and len(r) < 64 for r in ref), ref
    assert mode == "open" or all(r[0] == OPEN for r in ref)
    logit_bias = tuple((t, float(bias[t])) for t in (OPEN, CLOSE) if bias[t])
    params = SamplingParams(64, structured=spec, logit_bias=logit_bias, frequency_penalty=fp)
    ar = Engine(model, tokenizer=tok, options=EngineOptions(max_batch_size=2)).generate(ps, params)
    assert [r.token_ids for r in ar] == ref
    for r in ar:
        after = tok.decode(r.token_ids[r.token_ids.index(CLOSE) + 1 :])
        assert r.finish_reason == "stop" and list(json.loads(after)) == ["s", "n"], r.text
    truth = {i: p + r for i, (p, r) in enumerate(zip(ps, ref))}
    for name, res in every_isd_path(model, ps, params, truth, max_batch_size=2):
        assert [r.token_ids for r in res] == ref, name


def test_thinking_states_of_a_constraint():
    """A constraint whose grammar starts after the reasoning: inside the block nothing is masked and nothing forced;
    at the start the grammar's tokens and ``<think>``; a chunk position's state follows the tokens before it."""
    tok = think_tokenizer()
    book = GrammarBook(tok, 320, [0])
    tags = book.constraint(StructuredOutput(choice=("yes", "no"), after_thinking="tags"), [0])
    plain = book.constraint(StructuredOutput(choice=("yes", "no")), [0])
    first = plain.allowed([[]])[0]
    yes = tok("yes", add_special_tokens=False)["input_ids"]
    rows = tags.allowed([[], [OPEN], [OPEN, 5, 6], [OPEN, 5, CLOSE], [OPEN, CLOSE, *yes[:1]], yes[:1]])
    assert bool(rows[0][OPEN]) and torch.equal(
        rows[0] & ~torch.nn.functional.one_hot(torch.tensor(OPEN), 320).bool(), first
    )
    assert bool(rows[1].all()) and bool(rows[2].all())  # thinking: free
    assert torch.equal(rows[3], first) and torch.equal(rows[4], rows[5]) and not bool(rows[5][OPEN])
    assert tags.forced() == [] and not tags.done
    tags.add([OPEN, 7, 8])
    assert tags.state == "thinking" and tags.forced() == [] and bool(tags.allowed([[]])[0].all())
    tags.add([CLOSE, *yes])
    assert tags.state == "grammar" and tags.done
    opened = book.constraint(StructuredOutput(choice=("yes", "no"), after_thinking="open"), [0])
    assert opened.state == "thinking" and bool(opened.allowed([[OPEN]])[0].all())
    with pytest.raises(DLMError, match="needs <think> to be one token"):
        GrammarBook(TOK, len(TOK), [0]).constraint(StructuredOutput(json_object=True, after_thinking="open"))
    with pytest.raises(DLMError, match="after_thinking must be"):
        StructuredOutput(json_object=True, after_thinking="yes")
