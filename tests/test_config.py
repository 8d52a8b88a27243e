import dataclasses
from pathlib import Path

import pytest

from dlm.config import FLAT_KEYS, SECTIONS, TrainingConfig, load_config, resolve_key, section_keys
from dlm.errors import DLMError

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def test_defaults_sections_and_flat_keys_layer_in_order(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(
        "learning_rate: 3.0e-5\nper_device_train_batch_size: 2\ntrain:\n  max_minutes: 5\n"
        "cutoff_len: 128\nbf16: true\npacked_prefixes: a,b\n"
    )
    cfg = load_config(y, {"data": "x.jsonl", "train.max_minutes": "2.5", "optim": {"schedule": "constant"}})
    assert cfg.optim.learning_rate == 3e-5
    assert cfg.train.batch_size == 2 and cfg.data.seq_length == 128
    assert cfg.train.mixed_precision == "bf16"
    assert cfg.train.max_minutes == 2.5  # command line beats YAML
    assert cfg.optim.schedule == "constant"
    assert cfg.data.packed_prefixes == ["a", "b"]
    assert cfg.optim.warmup_ratio == TrainingConfig().optim.warmup_ratio  # untouched default


@pytest.mark.parametrize(
    "key, near",
    [
        ("train.max_minuts", "train.max_minutes"),
        ("lerning_rate", "learning_rate"),
        ("trian.batch_size", "train"),
        ("ce_alfa", "ce_alpha"),
    ],
)
def test_typo_names_the_key_and_the_closest(key, near):
    with pytest.raises(DLMError) as e:
        load_config(None, {"data": "x.jsonl", key: 1})
    msg = str(e.value)
    assert key.split(".")[0] in msg and near in msg


def test_typo_in_yaml_names_the_file(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("optim:\n  lerning_rate: 1\n")
    with pytest.raises(DLMError, match=r"optim\.lerning_rate.*bad\.yaml.*optim\.learning_rate"):
        load_config(y, {"data": "x"})


@pytest.mark.parametrize(
    "override, msg",
    [
        (["train.batch_size=two", "data.data=x"], "train.batch_size = 'two' is not a valid int"),
        (["train.batch_size=1.5", "data.data=x"], "not a valid int"),
        (["train.overwrite=maybe", "data.data=x"], "not a valid bool"),
        (["model.objective=ar", "data.data=x"], "model.objective"),
        (["train.max_train_steps=0", "data.data=x"], "train.max_train_steps"),
        ([], "exactly one data source"),
        (["data.data=x", "packed_data_dir=y"], "exactly one data source"),
        (["data.data=x", "packed_prefixes=a,b", "packed_weights=1"], "one weight per prefix"),
        (["data.data=x", "model.objective=mdm", "model.block_size=2"], "mdm"),
        (["data.data=x", "gated_lora=true"], "--lora-r"),
        (["data.data=x", "model.attn_impl=flash_attention_2"], "sdpa"),
    ],
)
def test_bad_values_are_clear_errors(override, msg):
    with pytest.raises(DLMError, match=msg.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, override)


def test_every_flat_key_maps_to_a_real_field():
    keys = set(section_keys())
    for flat, dotted in FLAT_KEYS.items():
        assert dotted in keys, flat
        assert resolve_key(flat) == dotted


def test_objective_sections_are_the_objective_configs_and_every_field_documents_itself():
    """One definition each: the mdm / block / idlm sections are the objectives' config classes; every field has
    help text (the --help line), choices where it has a fixed set, and the objectives' block size is no key of its
    own (model.block_size sets it)."""
    from dlm.config import field_help
    from dlm.objectives import config_class

    for name in ("mdm", "block", "idlm"):
        assert SECTIONS[name] is config_class(name), name
    for key in section_keys():
        section, field_name = key.split(".")
        f = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[field_name]
        assert len(f.metadata.get("help", "")) > 8, key
        assert "default" in field_help(key), key
    assert "choices" not in field_help("train.batch_size") and "bf16" in field_help("train.mixed_precision")
    with pytest.raises(DLMError, match="set from model.block_size"):
        load_config(None, {"idlm.block_size": 2, "data": "x"})
    with pytest.raises(DLMError, match=r"block\.t_per = 'tokens' is not valid; use one of: sample, block"):
        load_config(None, {"block.t_per": "tokens", "data": "x"})


def test_a_file_uses_sections_or_the_original_names_not_the_shortcuts(tmp_path):
    """One spelling per field in a file: the original trainers' keys work, dlm's command-line shortcuts are an
    error that says how to write the key."""
    ok = tmp_path / "ok.yaml"
    ok.write_text("cutoff_len: 128\nper_device_train_batch_size: 2\ndata:\n  data: x.jsonl\n")
    cfg = load_config(ok)
    assert cfg.data.seq_length == 128 and cfg.train.batch_size == 2 and cfg.data.data == "x.jsonl"
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_minutes: 5\ndata:\n  data: x.jsonl\n")
    with pytest.raises(DLMError, match=r"'max_minutes' in '.*bad.yaml' is a command-line shortcut.*train\.max_minutes"):
        load_config(bad)
    assert load_config(None, {"max_minutes": 5, "data": "x"}).train.max_minutes == 5  # flags / Python: fine


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_preset_parses_and_builds_its_objective(preset):
    from dlm.objectives import get_objective

    source = {"data.data": "x.jsonl", "data.packed_data_dir": None}
    cfg = load_config(preset, source)
    block = cfg.model.block_size if cfg.model.objective != "mdm" else None
    get_objective(cfg.model.objective, **cfg.objective_kwargs(block))
    if cfg.train.accelerate_config:
        assert (ROOT / cfg.train.accelerate_config).is_file()
    if cfg.data.idlm_block_size is not None:
        assert cfg.data.idlm_block_size == cfg.model.block_size


def test_published_idlm_presets_match_the_recipe():
    for b in (1, 2, 3):
        cfg = load_config(ROOT / f"configs/idlm_b{b}_qwen3_8b_gpu.yaml", {"data": "x"})
        assert cfg.model.objective == "idlm" and cfg.model.block_size == b
        assert cfg.optim.learning_rate == 1e-5 and cfg.optim.schedule == "cosine"
        assert cfg.optim.warmup_ratio == 0.03 and cfg.train.mixed_precision == "bf16"
        assert cfg.data.seq_length == 4096
        assert cfg.train.batch_size * cfg.train.gradient_accumulate_every * 8 == 32  # 8 GPUs in the launcher
        assert cfg.idlm.loss_auto_balance == (b == 3)
        assert "deepspeed_zero2" in cfg.train.accelerate_config
    cpu = load_config(ROOT / "configs/diffullama_cpu.yaml", {"packed_data_dir": "d"})
    assert cpu.model.objective == "mdm" and cpu.mdm.attention == "annealed"


def test_accelerate_configs_are_valid_yaml_and_json():
    import json

    import yaml

    for f in (ROOT / "configs/accelerate").iterdir():
        data = json.loads(f.read_text()) if f.suffix == ".json" else yaml.safe_load(f.read_text())
        assert isinstance(data, dict) and data, f
    ds = yaml.safe_load((ROOT / "configs/accelerate/deepspeed_zero2.yaml").read_text())
    assert (ROOT / ds["deepspeed_config"]["deepspeed_config_file"]).is_file()


def test_cli_flags_and_section_keys(capsys):
    from dlm.cli import build_parser
    from dlm.commands.train import build_config

    parser = build_parser()
    args = parser.parse_args(
        [
            "train",
            "--config",
            str(ROOT / "configs/idlm_b2_cpu.yaml"),
            "--data",
            "c.jsonl",
            "--batch-size",
            "3",
            "--packed-prefixes",
            "a",
            "b",
            "--optim.warmup_ratio",
            "0.1",
            "--resume",
            "--gated-lora",
            "--lora-r",
            "4",
            "--max-minutes",
            "1.5",
        ]
    )
    cfg = build_config(args)
    assert cfg.train.batch_size == 3 and cfg.optim.warmup_ratio == 0.1 and cfg.train.resume == "auto"
    assert cfg.lora.gated and cfg.lora.r == 4 and cfg.train.max_minutes == 1.5
    assert cfg.data.packed_prefixes == ["a", "b"] and cfg.model.block_size == 2
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["train", "--data", "c.jsonl", "--train.max_minuts", "3"])
    assert e.value.code == 2
    assert "did you mean: --train.max_minutes" in capsys.readouterr().err


def test_a_dlm_trains_on_with_its_own_objective(tmp_path):
    """Without --objective (flag, section key or YAML) a DLM folder - dlm's own or a published family's - trains with
    the objective it has; an AR model keeps the default (idlm) and a given objective always wins."""
    import json

    from dlm.cli import build_parser
    from dlm.commands.train import build_config

    def objective(model, *extra, config=None):
        argv = ["train", "--model", str(model), "--data", "c.jsonl", *extra]
        return build_config(
            build_parser().parse_args(argv + (["--config", str(config)] if config else []))
        ).model.objective

    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"model_type": "llama", "dlm_objective": "mdm"}))
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({"model_type": "llada2_moe"}))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert objective(own) == "mdm" and objective(published) == "block"
    assert objective(plain) == "idlm" and objective("smollm2-135m") == "idlm"
    assert objective(own, "--objective", "block") == "block"
    assert objective(own, "--model.objective", "idlm") == "idlm"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("model:\n  objective: block\n")
    assert objective(own, config=yaml_file) == "block"


def test_presets_ship_in_the_package_and_load_by_name():
    """``dlm train --config idlm_b2_cpu`` works from an installed wheel: the presets live inside the package, the
    package data globs of pyproject.toml cover each of them (and match something each), and every preset opens
    with the command line that runs it, naming itself."""
    import tomllib

    from dlm.config import PRESET_DIR, preset_path, presets

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dlm"]
    shipped = set()
    for g in globs:
        matched = set(PRESET_DIR.parent.glob(g))
        assert matched, f"package-data glob {g!r} matches no file"
        shipped |= matched
    for f in PRESET_DIR.rglob("*"):
        assert not f.is_file() or f in shipped, f"{f} is not in the package data"
    assert len(presets()) >= 10
    for name in presets():
        first = preset_path(name).read_text().splitlines()[0]
        assert first.startswith(("# dlm train ", "# accelerate launch ")), (name, first)
        text = preset_path(name).read_text()
        assert f"--config {name} " in text or text.splitlines()[0].endswith(f"--config {name}"), name
        assert load_config(name, {"data.data": "x.jsonl", "data.packed_data_dir": None}).model.objective
    assert load_config("configs/idlm_b1_cpu.yaml", {"data": "x"}).model.block_size == 1  # a clone's path
    with pytest.raises(DLMError, match="did you mean idlm_b2_cpu"):
        load_config("idlm_b2_cp")
    with pytest.raises(DLMError, match="does not exist"):
        load_config("no/such/file.yaml")


def test_the_docs_alias_table_is_the_code_s():
    from dlm.config import alias_table

    text = (ROOT / "docs" / "training.md").read_text()
    begin = text.index("<!-- aliases:begin")
    body = text[text.index("\n", begin) + 1 : text.index("<!-- aliases:end -->")]
    assert body.strip() == alias_table(), "docs/training.md's alias table is stale: regenerate it from alias_table()"


def test_renamed_key_still_read_with_a_warning():
    """data.block_length (the I-DLM data block) is renamed data.idlm_block_size: the old key is read for one
    release, with a warning naming the new one; I-DLM's flat YAML key block_length stays an alias."""
    with pytest.warns(FutureWarning, match="'data.block_length' on the command line is renamed 'data.idlm_block_size'"):
        cfg = load_config(None, ["data.block_length=2", "model.block_size=2"], validate=False)
    assert cfg.data.idlm_block_size == 2
    assert load_config(None, {"block_length": 3}, validate=False).data.idlm_block_size == 3
