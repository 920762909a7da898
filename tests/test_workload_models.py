"""Model configs: published sizes, defaults, and one-line errors for every kind of bad file."""

import pytest
import yaml

from phaze_opt.training import Layout
from phaze_opt import configs
from phaze_opt.errors import PhazeError
from phaze_opt.workload.graphs import model_params
from phaze_opt.workload.models import ModelConfig, load_model, parse_model

MODELS = ("gpt3-175b", "gpt2-xl", "bert-large", "opt-1.3b", "llama2-7b", "llama2-70b", "megatron-8.3b")

# Published sizes (the issue's list): GPT-3 174.6B (Narayanan et al. 2021, Table 1), GPT-2 XL 1.56B,
# BERT-large ~335M without the pooler, OPT-1.3B (the released checkpoint: 1,315,758,080), Llama-2-7B
# 6.74B, Llama-2-70B ~69B, Megatron 8.3B.
PUBLISHED = {
    "gpt3-175b": 174.6e9,
    "gpt2-xl": 1.56e9,
    "bert-large": 335e6,
    "opt-1.3b": 1.3158e9,
    "llama2-7b": 6.74e9,
    "llama2-70b": 69e9,
    "megatron-8.3b": 8.3e9,
}
# Exact counts of the released Hugging Face checkpoints.
EXACT = {
    "gpt2-xl": 1_557_611_200,
    "opt-1.3b": 1_315_758_080,
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
}


# The Megatron-LM GPTs of the validation suites (configs/validation/); their sizes and shapes are tested
# in test_validation_suites.py.
MEGATRON = tuple(f"megatron-gpt-{size}" for size in (
    "1.7b", "3.6b", "7.5b", "18.4b", "39.1b", "76.1b", "145.6b", "310.1b", "530b", "1t", "22b", "175b"))


# Mixture-of-experts models; their sizes are tested in test_workload_moe.py.
MOE = ("mixtral-8x7b", "deepseek-moe-16b", "llama2-7b-32k")  # and the long-context Llama

# Models trained since 2023 (decoupled heads, MQA, QK-norm, windows, parallel blocks, MLA, MTP); their
# sizes are tested in test_workload_modern.py.
MODERN = ("llama3-8b", "llama3-70b", "llama3-405b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
          "gpt-oss-120b", "nemotron-4-15b", "nemotron-4-340b", "palm-540b")


def test_every_shipped_config_is_listed():
    assert sorted(configs.available("models")) == sorted(MODELS + MEGATRON + MOE + MODERN)


@pytest.mark.parametrize("name", MODELS)
def test_params_within_one_percent_of_published(name):
    total = model_params(load_model(name))
    assert abs(total / PUBLISHED[name] - 1) < 0.01, (name, total)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_params_equal_released_checkpoints(name):
    assert model_params(load_model(name)) == EXACT[name]


def test_table_fields_from_the_issue():
    expect = {
        "gpt3-175b": (96, 12288, 96, 96, 2048, 50257),
        "gpt2-xl": (48, 1600, 25, 25, 1024, 50257),
        "bert-large": (24, 1024, 16, 16, 512, 30522),
        "opt-1.3b": (24, 2048, 32, 32, 2048, 50272),
        "llama2-7b": (32, 4096, 32, 32, 4096, 32000),
        "llama2-70b": (80, 8192, 64, 8, 4096, 32000),
        "megatron-8.3b": (72, 3072, 24, 24, 1024, 51200),
    }
    for name, fields in expect.items():
        m = load_model(name)
        assert (m.layers, m.hidden, m.heads, m.kv_heads, m.seq, m.vocab) == fields, name
    assert load_model("llama2-7b").ffn == 11008 and load_model("llama2-70b").ffn == 28672
    assert load_model("llama2-7b").activation == "swiglu" and load_model("llama2-7b").norm == "rmsnorm"
    assert load_model("bert-large").causal is False and load_model("gpt3-175b").causal is True


def test_tp_widths_default_to_divisors_of_heads():
    assert load_model("gpt2-xl").tp_widths == (1,)  # 25 heads
    assert load_model("gpt3-175b").tp_widths == (1, 2, 4, 8)
    assert load_model("llama2-70b").tp_widths == (1, 2, 4, 8)  # 8 KV heads


def test_expert_placements():
    assert load_model("gpt3-175b").expert_placement == Layout(tp=4, pp=32, dp=8)
    for name in MODELS:
        m = load_model(name)
        e = m.expert_placement
        assert e.tp in m.tp_widths and e.tp * e.pp * e.dp <= 1024, name


def test_load_by_path_equals_by_name():
    by_name = load_model("llama2-70b")
    by_path = load_model(str(configs.resolve("models", "llama2-70b")))
    assert by_name == by_path and hash(by_name) == hash(by_path)
    assert load_model(by_name) is by_name


BASE = {
    "name": "tiny", "family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32,
    "vocab": 100, "activation": "gelu", "norm": "layernorm", "position": "learned",
    "tied_embeddings": True, "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
}


def _write(tmp_path, data, name="m.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_config_is_valid(tmp_path):
    m = load_model(str(_write(tmp_path, BASE)))
    assert isinstance(m, ModelConfig) and m.tp_widths == (1, 2, 4) and m.kv_heads == 4 and m.positions == 32


def _changed(**kw):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for k, v in kw.items():
        if v is _DROP:
            data.pop(k)
        else:
            data[k] = v
    return data


_DROP = object()

BAD = [
    (_changed(colour="red"), "colour", "unknown field"),
    (_changed(hidden=_DROP), "hidden", "missing required field"),
    (_changed(heads=5), "heads", "must divide hidden"),
    (_changed(kv_heads=3), "kv_heads", "must divide heads"),
    (_changed(family="t5"), "family", "must be one of"),
    (_changed(layers=0), "layers", "positive integer"),
    (_changed(layers=True), "layers", "positive integer"),
    (_changed(seq="long"), "seq", "positive integer"),
    (_changed(activation="swish"), "activation", "must be one of"),
    (_changed(tied_embeddings="yes"), "tied_embeddings", "true or false"),
    (_changed(dropout=1.5), "dropout", "[0, 1)"),
    (_changed(tp_widths=[1, 3]), "tp_widths", "must divide heads"),
    (_changed(tp_widths=[]), "tp_widths", "non-empty list"),
    (_changed(tp_widths=[1, 1]), "tp_widths", "repeated"),
    (_changed(positions=16), "positions", "at least seq"),
    (_changed(position="rotary", hidden=36, heads=4), "position", "even head size"),
    (_changed(expert_placement={"tp": 8, "pp": 1, "dp": 1}), "expert_placement.tp", "TP widths"),
    (_changed(expert_placement={"tp": 1, "pp": 1}), "dp", "missing"),
    (_changed(expert_placement={"tp": 1, "pp": 0, "dp": 1}), "expert_placement.pp", "positive integer"),
    (_changed(expert_placement={"tp": 1, "pp": 9, "dp": 1}), "expert_placement.pp", "cannot exceed"),
    (_changed(dtype="int8"), "dtype", "must be one of"),
    (_changed(type_vocab=-1), "type_vocab", "non-negative"),
]


@pytest.mark.parametrize("data,field,problem", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, data, field, problem):
    path = _write(tmp_path, data)
    with pytest.raises(PhazeError) as info:
        load_model(str(path))
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg and f"'{field}'" in msg and problem in msg, msg


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nlayers: [1, 2\n")
    with pytest.raises(PhazeError, match=r"broken.yaml: malformed YAML at line"):
        load_model(str(path))


def test_unknown_model_name_lists_choices():
    with pytest.raises(PhazeError) as info:
        load_model("gpt5")
    assert "unknown model 'gpt5'" in str(info.value) and "gpt3-175b" in str(info.value)


def test_parse_accepts_in_memory_mapping():
    m = parse_model(_changed(family="llama", activation="swiglu", norm="rmsnorm", position="rotary",
                             bias=False, tied_embeddings=False), "inline")
    assert m.positions == 0 and m.bias is False and m.source == "inline"


# Sizes no model has are refused on load, naming the file, the field and the limit.
TOO_BIG = [
    (_changed(layers=100_000), "layers", "at most 10,000"),
    (_changed(seq=10_000_000, positions=10_000_000), "seq", "at most 1,048,576"),
    (_changed(hidden=2**21, heads=4), "hidden", "at most 1,048,576"),
    (_changed(heads=2**15, hidden=2**16), "heads", "at most 16,384"),
    (_changed(ffn=2**23), "ffn", "at most 4,194,304"),
    (_changed(vocab=2**25), "vocab", "at most 16,777,216"),
    (_changed(positions=2**21), "positions", "at most 1,048,576"),
    (_changed(type_vocab=2**25), "type_vocab", "at most 16,777,216"),
    (_changed(expert_placement={"tp": 1, "pp": 1, "dp": 2**30}), "expert_placement.dp", "at most 1,048,576"),
]


@pytest.mark.parametrize("data,field,problem", TOO_BIG, ids=[b[1] for b in TOO_BIG])
def test_sizes_no_model_has_are_refused_naming_the_limit(tmp_path, data, field, problem):
    test_bad_config_is_one_line_naming_file_and_field(tmp_path, data, field, problem)


def test_the_largest_allowed_sizes_load():
    from phaze_opt.workload.models import LIMITS

    top = _changed(layers=LIMITS["layers"].maximum, seq=LIMITS["seq"].maximum, vocab=LIMITS["vocab"].maximum,
                   ffn=LIMITS["ffn"].maximum, hidden=LIMITS["hidden"].maximum, heads=LIMITS["heads"].maximum)
    assert parse_model(top, "top.yaml").layers == 10_000
