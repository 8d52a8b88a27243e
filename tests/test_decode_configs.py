"""The decoders' configs and registry (dlm.decode.configs): one definition per setting, the same flags on every
command, checks before a model loads, the renamed spellings still read, the docs table in sync."""

import dataclasses
import inspect
import warnings
from pathlib import Path

import pytest

from dlm.decode.configs import (
    DECODERS,
    REGISTRY,
    ARConfig,
    BlockConfig,
    ISDConfig,
    MDMConfig,
    build_decoder,
    config_from_args,
    make_config,
    settings_table,
)
from dlm.errors import DLMError

ROOT = Path(__file__).resolve().parents[1]


def parser_of(command: str):
    from dlm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command]


def decoder_flags(command: str) -> set[str]:
    """The visible decoder-setting flags of a command (the ones stored as decoder_<field>)."""
    return {
        s
        for a in parser_of(command)._actions
        if a.dest.startswith("decoder_") and a.help != "==SUPPRESS=="
        for s in a.option_strings
    }


def parse(command: str, *argv: str):
    base = {"generate": ["--prompt", "x"], "serve": [], "eval": []}[command]
    return parser_of(command).parse_args([*base, *argv])


def test_registry_maps_each_name_to_its_decoder_and_config():
    from dlm.decode import DECODERS as PUBLIC
    from dlm.decode.engine import Decoder

    assert PUBLIC == DECODERS == ("ar", "mdm", "block", "isd", "renoise")
    for name, entry in REGISTRY.items():
        cls = entry.decoder_class()
        assert issubclass(cls, Decoder) and cls.name == name and entry.config.name == name
        config = entry.config()
        decoder = build_decoder(config)
        assert isinstance(decoder, cls) and decoder.config is config
        # a decoder is constructed from its config alone: no keyword spelling of its settings
        assert list(inspect.signature(cls.__init__).parameters) == ["self", "config"], name
        assert isinstance(cls().config, entry.config), name  # no config: the config's defaults


def test_every_command_takes_the_same_decoder_flags():
    every = {
        f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        for e in REGISTRY.values()
        for f in dataclasses.fields(e.config)
    }
    assert decoder_flags("generate") == decoder_flags("serve") == decoder_flags("eval") == every
    choices = {c: next(a for a in parser_of(c)._actions if a.dest == "decode").choices for c in ("generate", "serve")}
    assert tuple(choices["generate"]) == tuple(choices["serve"]) == DECODERS
    assert tuple(next(a for a in parser_of("eval")._actions if a.dest == "decode").choices) == ("auto", *DECODERS)


def test_flags_build_the_config_with_each_command_s_defaults():
    from dlm.commands.serve import SERVE_DEFAULTS

    # generate: ar unless the model runs only its own decoder (a renoising model: renoise), decided with the folder
    args = parse("generate")
    assert args.decode is None and config_from_args(args, "ar") == ARConfig()
    # isd: drafting measured ("auto") by default, on every command and in Python
    assert config_from_args(parse("generate", "--decode", "isd")).draft_budget == "auto" == ISDConfig().draft_budget
    args = parse("generate", "--decode", "isd", "--stride", "3", "--isd-fallback", "all", "--isd-draft-budget", "6")
    assert config_from_args(args) == ISDConfig(stride=3, fallback="all", draft_budget=6)
    args = parse("generate", "--decode", "mdm", "--sampler", "llada", "--semi-ar-block", "8", "--cfg-scale", "1.5")
    assert config_from_args(args) == MDMConfig(sampler="llada", semi_ar_block=8, cfg_scale=1.5)
    args = parse("generate", "--decode", "block", "--steps", "4", "--threshold", "0")
    assert config_from_args(args) == BlockConfig(steps=4, threshold=0.0)
    # the server: isd by default, drafting measured ("auto") unless the flag says otherwise
    args = parse("serve")
    assert args.decode is None and config_from_args(args, "isd", SERVE_DEFAULTS) == ISDConfig(draft_budget="auto")
    args = parse("serve", "--isd-draft-budget", "always")
    assert config_from_args(args, "isd", SERVE_DEFAULTS).draft_budget == "always"
    # ar: prompt lookup's drafting measured too (it drafts only with --prompt-lookup K)
    assert config_from_args(parse("serve", "--decode", "ar"), None, SERVE_DEFAULTS) == ARConfig(lookup_budget="auto")
    # the server states its own default in its help
    serve_help = parser_of("serve").format_help()
    assert "default auto" in " ".join(serve_help.split())


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--decode", "ar", "--steps", "4"],
            "--steps: not a setting of --decode ar; drop it or use --decode block or --decode mdm",
        ),
        (["--decode", "ar", "--stride", "2"], "--stride is an ISD setting; drop it or use --decode isd"),
        (["--decode", "block", "--sampler", "random"], "--sampler is an MDM setting"),
        (["--decode", "isd", "--semi-ar-block", "4"], "--semi-ar-block is an MDM setting"),
        (["--decode", "mdm", "--sampler", "best"], "--sampler must be one of confidence, random"),
        (["--decode", "isd", "--stride", "1"], "--stride must be an integer >= 2"),
        (["--decode", "isd", "--isd-candidates", "9"], "--isd-candidates must be an integer from 1 to 8"),
        (["--decode", "isd", "--isd-draft-budget", "soon"], "--isd-draft-budget .* positive integer, 'auto'"),
        (["--decode", "mdm", "--sampler", "dream", "--cfg-scale", "1"], "--cfg-scale is a setting of --sampler llada"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(argv, words):
    with pytest.raises(DLMError, match=words):
        config_from_args(parse("generate", *argv))


def test_a_command_refuses_them_before_any_model_loads(capsys):
    from dlm.cli import main

    # no such model: the settings fail first, with exit status 2 and the flag named
    assert main(["generate", "--model", "/nonexistent", "--prompt", "x", "--decode", "ar", "--steps", "3"]) == 2
    assert "--steps: not a setting of --decode ar" in capsys.readouterr().err
    assert main(["serve", "--model", "/nonexistent", "--isd-fallback", "sometimes"]) == 2
    assert "--isd-fallback must be one of predict, all, off" in capsys.readouterr().err
    assert main(["eval", "--model", "/nonexistent", "--stride", "3", "--steps", "2"]) == 2
    assert "no one decoder takes all of these" in capsys.readouterr().err


def test_old_spellings_are_read_with_a_note(capsys):
    args = parse("generate", "--decode", "mdm", "--block-length", "8")
    assert config_from_args(args) == MDMConfig(semi_ar_block=8)
    assert "--block-length is renamed --semi-ar-block" in capsys.readouterr().err
    args = parse("serve", "--isd-token-budget", "always")
    assert config_from_args(args, "isd").draft_budget == "always"
    assert "--isd-token-budget is renamed --isd-draft-budget" in capsys.readouterr().err
    args = parse("eval", "--decode", "mdm", "--gen-steps", "5", "--token-budget", "100")
    assert config_from_args(args) == MDMConfig(steps=5) and args.score_batch_tokens == 100
    err = capsys.readouterr().err
    assert "--gen-steps is renamed --steps" in err and "--token-budget is renamed --score-batch-tokens" in err
    # the old help is gone: only the new spellings are listed
    assert "--block-length" not in parser_of("generate").format_help()
    # the Python keywords
    for old, new, value, name in (
        ("token_budget", "draft_budget", 4, "isd"),
        ("block_length", "semi_ar_block", 8, "mdm"),
        ("method", "sampler", "random", "mdm"),
    ):
        with pytest.warns(DeprecationWarning, match=f"{old}= is deprecated and will be removed .*: use {new}="):
            assert getattr(make_config(name, **{old: value}), new) == value


def test_a_config_object_and_keywords_do_not_mix():
    assert make_config(ISDConfig(stride=3)) == ISDConfig(stride=3)
    assert make_config("isd", stride=None, fallback=None) == ISDConfig()  # None = not given
    with pytest.raises(DLMError, match="not both"):
        make_config(ISDConfig(), stride=3)
    with pytest.raises(DLMError, match="unknown decoder 'mdn'.*did you mean mdm"):
        make_config("mdn")
    with pytest.raises(DLMError, match="unknown decoder setting"):
        make_config("isd", strid=3)


def test_the_python_api_takes_a_config():
    """generate / load_engine / the engine: a config gives the same tokens as the deprecated loose keywords."""
    from dlm.decode import generate
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.testing import make_model, make_tokenizer

    dlm = convert_ar_to_dlm(make_model("llama"), "idlm", tokenizer=make_tokenizer(), block_size=2)
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ar = [r.token_ids for r in generate(dlm, prompts, ARConfig(), params)]
    isd = generate(dlm, prompts, ISDConfig(stride=3, fallback="all"), params)
    assert [r.token_ids for r in isd] == ar  # greedy ISD == AR
    assert all(len(r.stats.acceptance) == 2 for r in isd)  # stride 3: two draft positions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loose = generate(dlm, prompts, "isd", params, stride=3, fallback="all")
    assert [r.token_ids for r in loose] == ar
    assert any(issubclass(w.category, DeprecationWarning) and "ISDConfig" in str(w.message) for w in caught)


def test_docs_table_is_the_code_s():
    text = (ROOT / "docs" / "decoding.md").read_text()
    begin = text.index("<!-- settings:begin")
    body = text[text.index("\n", begin) + 1 : text.index("<!-- settings:end -->")]
    assert body == settings_table(), "docs/decoding.md's settings table is stale: regenerate it from settings_table()"


def test_auto_is_each_objective_s_own_decoder():
    from dlm.decode.configs import own_decoder

    objectives = (None, "idlm", "mdm", "block", "renoise")
    assert [own_decoder(o) for o in objectives] == ["ar", "isd", "mdm", "block", "renoise"]
    assert {e.objective for e in REGISTRY.values()} == set(objectives)
