"""A checkpoint's configuration read as transformers reads it, and refused in one line naming the
file and the field where it cannot be read.

The checkpoints are tiny random Llamas written by transformers (``save_pretrained``, or as a
GGUF file in llama.cpp's layout), with their ``config.json`` or metadata edited the way a
hand-edited or badly converted file is.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from scheduler.model.checkpoint import CheckpointError, LlamaConfig, UnsupportedCheckpoint
from scheduler.model.gguf_checkpoint import permute_rotary_rows
from scheduler.model.hf_config import HF_DEFAULTS
from scheduler.model.llama import RealModel
from scheduler.model.loader import load_checkpoint
from scheduler.runner import ForwardItem
from tests.test_checkpoint import VOCAB, _gguf_name, tiny_hf_model
from tests.test_own_checkpoint import refused_by_both, tiny_directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama directory (with a tokenizer), copied by each test that edits it."""
    return tiny_directory(tmp_path_factory.mktemp("tiny") / "llama")


def edited(saved: Path, where: Path, edit: Callable[[dict[str, Any]], object]) -> Path:
    """A copy of ``saved`` at ``where`` whose config.json ``edit`` changed in place."""
    shutil.copytree(saved, where)
    config = json.loads((where / "config.json").read_text())
    edit(config)
    (where / "config.json").write_text(json.dumps(config))
    return where


def _set(**fields: object) -> Callable[[dict[str, Any]], object]:
    return lambda config: config.update(fields)


def _drop(*keys: str) -> Callable[[dict[str, Any]], object]:
    return lambda config: [config.pop(key) for key in keys]


_EOS_IDS = "eos_token_id must be a token id (an integer >= 0) or a list of them, got "

BAD_CONFIGS = {
    "no_intermediate_size": (_drop("intermediate_size"), "intermediate_size is missing"),
    "no_layers": (_drop("num_hidden_layers"), "num_hidden_layers is missing"),
    "heads_a_word": (_set(num_attention_heads="four"),
                     'num_attention_heads must be a positive integer, got "four"'),
    "theta_null": (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=None)),
                   "rope_theta must be a positive number, got null"),
    "linear_without_factor": (_set(rope_parameters={"rope_type": "linear",
                                                    "rope_theta": 10000.0}),
                              "rope_parameters.factor is missing"),
    "rope_parameters_a_list": (_set(rope_parameters=[1, 2]),
                               "rope_parameters must be an object or null, got [1, 2]"),
    "eps_a_string": (_set(rms_norm_eps="1e-5"),
                     'rms_norm_eps must be a positive number, got "1e-5"'),
    "tie_a_string": (_set(tie_word_embeddings="yes"),
                     'tie_word_embeddings must be true or false, got "yes"'),
    "kv_heads_not_dividing": (_set(num_key_value_heads=3),
                              "heads (4) must be a multiple of kv_heads (3)"),
    "eos_a_word_in_a_list": (_set(eos_token_id=["a"]), _EOS_IDS + '["a"]'),
    "eos_a_bool": (_set(eos_token_id=True), _EOS_IDS + "true"),
    "eos_negative": (_set(eos_token_id=[2, -1]), _EOS_IDS + "[2, -1]"),
    "eos_a_string": (_set(eos_token_id="2"), _EOS_IDS + '"2"'),
    "eos_a_float": (_set(eos_token_id=2.0), _EOS_IDS + "2.0"),
    # An EOS id the output head has no row for is never sampled: answers would never end on it.
    "eos_the_vocabulary_size": (_set(eos_token_id=VOCAB), f"eos_token_id {VOCAB} is not a token "
                                f"id of the model's vocabulary of {VOCAB} tokens (0..{VOCAB - 1})"),
    "eos_beyond_in_a_list": (_set(eos_token_id=[2, VOCAB + 7]),
                             f"eos_token_id {VOCAB + 7} is not a token id of the model's "
                             f"vocabulary of {VOCAB} tokens (0..{VOCAB - 1})"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_config_json_that_cannot_be_read_is_refused_naming_the_field(saved, tmp_path, case):
    """Each of these raised a KeyError, TypeError, ValueError or AttributeError (or named no
    file), which ``pdlife generate`` printed as a traceback."""
    edit, said = BAD_CONFIGS[case]
    where = edited(saved, tmp_path / case, edit)
    expected = f"{where / 'config.json'}: {said}"
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        load_checkpoint(where)


def test_a_config_json_without_a_shape_field_is_one_line_at_the_command_line(saved, tmp_path,
                                                                              capsys):
    where = edited(saved, tmp_path / "cut", _drop("intermediate_size"))
    said = refused_by_both(capsys, str(where))
    assert said == f"{where / 'config.json'}: intermediate_size is missing\n"


@pytest.mark.parametrize("eos", [["a"], False, [2, -1], [[2]], {"id": 2}])
def test_a_generation_config_s_eos_ids_are_refused_naming_the_field(saved, tmp_path, eos):
    """The tokenizer stops on generation_config.json's EOS ids, and dropped those it could not
    read: a server whose answers never ended on EOS."""
    where = tmp_path / "generation"
    shutil.copytree(saved, where)
    file = where / "generation_config.json"
    generation = json.loads(file.read_text())
    assert "eos_token_id" in generation  # save_pretrained writes config.json's
    file.write_text(json.dumps(generation | {"eos_token_id": eos}))
    expected = f"{file}: {_EOS_IDS}{json.dumps(eos)}"
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        load_checkpoint(where)


@pytest.mark.parametrize("eos", [VOCAB, [1, VOCAB + 1]])
def test_a_generation_config_s_eos_ids_beyond_the_vocabulary_are_refused(saved, tmp_path, eos):
    where = tmp_path / "generation"
    shutil.copytree(saved, where)
    file = where / "generation_config.json"
    file.write_text(json.dumps({"eos_token_id": eos}))
    beyond = eos if isinstance(eos, int) else eos[-1]
    expected = (f"{file}: eos_token_id {beyond} is not a token id of the model's vocabulary "
                f"of {VOCAB} tokens (0..{VOCAB - 1})")
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        load_checkpoint(where)
    file.write_text(json.dumps({"eos_token_id": VOCAB - 1}))  # the last id is one
    assert load_checkpoint(where).config.vocab_size == VOCAB


def test_a_bad_eos_id_is_one_line_at_the_command_line(saved, tmp_path, capsys):
    where = tmp_path / "generation"
    shutil.copytree(saved, where)
    (where / "generation_config.json").write_text(json.dumps({"eos_token_id": ["a"]}))
    said = refused_by_both(capsys, str(where))
    assert said == f"{where / 'generation_config.json'}: {_EOS_IDS}[\"a\"]\n"
    (where / "generation_config.json").write_text("[2]")
    assert refused_by_both(capsys, str(where)) == (
        f"{where / 'generation_config.json'}: not a JSON object\n")


def write_tiny_gguf(path: Path, *, meta: Mapping[str, object] = {},
                    types: Mapping[str, type] = {}, extra: Mapping[str, np.ndarray] = {},
                    hf: Any = None, eos: int | None = None) -> None:
    """A tiny random Llama (``hf``, else ``tiny_hf_model()``) as a float32 GGUF file in
    llama.cpp's layout; ``meta`` sets ``llama.*`` fields (None leaves one out), ``types``
    stores the named tensors' values as another numpy type (``np.float64`` makes an F64
    tensor), ``extra`` adds tensors (``rope_freqs.weight``), ``eos`` the tokenizer's EOS id."""
    hf = tiny_hf_model() if hf is None else hf
    c = hf.config
    fields: dict[str, object] = {
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": c.rms_norm_eps, "rope.freq_base": 10000.0,
    }
    fields.update(meta)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, list):
            w.add_array(f"llama.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"llama.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        else:
            w.add_string(f"llama.{key}", str(value))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["t 1"])
    if eos is not None:
        w.add_eos_token_id(eos)
    for name, tensor in hf.state_dict().items():
        gguf_name, kind = _gguf_name(name)
        data = tensor.float()
        if kind == "attn_q":
            data = permute_rotary_rows(data, c.num_attention_heads)
        elif kind == "attn_k":
            data = permute_rotary_rows(data, c.num_key_value_heads)
        w.add_tensor(gguf_name, data.numpy().astype(types.get(gguf_name, np.float32)))
    for name, array in extra.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


BAD_GGUF = {
    "kv_heads_per_layer": (dict(meta={"attention.head_count_kv": [2, 2]}),
                           "metadata llama.attention.head_count_kv is a per-layer array "
                           "([2, 2]); pdlife's runner takes one value for every layer"),
    "linear_without_factor": (dict(meta={"rope.scaling.type": "linear"}),
                              "metadata llama.rope.scaling.type is linear and "
                              "llama.rope.scaling.factor is missing"),
    "heads_a_string": (dict(meta={"attention.head_count": "four"}),
                       "metadata llama.attention.head_count must be a positive integer, "
                       "got 'four'"),
    "no_epsilon": (dict(meta={"attention.layer_norm_rms_epsilon": None}),
                   "metadata llama.attention.layer_norm_rms_epsilon is missing"),
    "partial_rotary": (dict(meta={"rope.dimension_count": 32}),
                       "metadata llama.rope.dimension_count is 32, the head dim 64 "
                       "(llama.attention.key_length, else embedding_length / head_count): "
                       "partial rotary embeddings (RoPE on part of each head) are not "
                       "supported"),
    "partial_rotary_beside_a_key_length": (
        dict(meta={"attention.key_length": 64, "rope.dimension_count": 16}),
        "metadata llama.rope.dimension_count is 16, the head dim 64"),
    "values_of_another_size": (dict(meta={"attention.value_length": 32}),
                               "metadata llama.attention.value_length is 32, the head dim 64 "
                               "(llama.attention.key_length, else embedding_length / "
                               "head_count): values of another size than keys are not "
                               "supported"),
    "rope_freqs_misshapen": (dict(extra={"rope_freqs.weight": np.ones(5, np.float32)}),
                             "weight 'rope_freqs.weight' has shape (5,), the config says "
                             "(32,) (one factor per rotary frequency)"),
    "rope_freqs_and_linear": (dict(extra={"rope_freqs.weight": np.ones(32, np.float32)},
                                   meta={"rope.scaling.type": "linear",
                                         "rope.scaling.factor": 2.0}),
                              "the checkpoint carries per-frequency RoPE factors "
                              "('rope_freqs.weight') and a linear RoPE scaling; the runner "
                              "applies one or the other, not both"),
    "f64_tensor": (dict(types={"blk.0.attn_norm.weight": np.float64}),
                   "tensor 'blk.0.attn_norm.weight' is F64, a type the gguf package does "
                   "not dequantize"),
}


@pytest.mark.parametrize("case", sorted(BAD_GGUF))
def test_gguf_metadata_or_tensors_that_cannot_be_read_are_refused_naming_them(tmp_path, case):
    """These raised a TypeError, KeyError or gguf's NotImplementedError, or loaded and computed
    something else: a partial rotary dimension rotated the whole head, and rope_freqs beside a
    linear scaling dropped the scaling."""
    options, said = BAD_GGUF[case]
    path = tmp_path / f"{case}.gguf"
    write_tiny_gguf(path, **options)
    with pytest.raises(CheckpointError, match=f"^{re.escape(f'{path}: {said}')}"):
        load_checkpoint(path)


def test_a_gguf_eos_id_beyond_the_models_vocabulary_is_refused(tmp_path):
    """The file's tokens outnumber the model's output rows (its vocab_size): an EOS id among
    the tokens but beyond the rows is refused naming the field; the last row's id loads."""
    rows = VOCAB - 32
    options: dict[str, Any] = dict(meta={"vocab_size": rows}, hf=tiny_hf_model(vocab_size=rows))
    path = tmp_path / "beyond.gguf"
    write_tiny_gguf(path, eos=rows, **options)
    expected = (f"{path}: metadata tokenizer.ggml.eos_token_id {rows} is not a token id of the "
                f"model's vocabulary of {rows} tokens (0..{rows - 1})")
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        load_checkpoint(path)
    write_tiny_gguf(path, eos=rows - 1, **options)
    assert load_checkpoint(path).config.vocab_size == rows


LONG_IDS = [(7 * i + 3) % VOCAB for i in range(96)]


def assert_computes_as_transformers(where: Path) -> LlamaConfig:
    """pdlife's logits at every position of ``LONG_IDS`` are transformers' (which reads the
    same directory); the config pdlife read."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([LONG_IDS])).logits[0].float()
    checkpoint = load_checkpoint(where)
    model = RealModel(checkpoint)
    pool = model.make_pool(num_pages=6, page_size=16)
    ours = model.logits(pool, [ForwardItem("t", tuple(LONG_IDS), 0, tuple(range(6)),
                                           all_logits=True)])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    return checkpoint.config


def test_rope_theta_is_read_from_rope_parameters_before_the_top_level(saved, tmp_path):
    """transformers 5.x takes ``rope_parameters``' theta and the top-level ``rope_theta`` only
    where the dict has none; pdlife took the top-level one first."""
    both = edited(saved, tmp_path / "both", _set(
        rope_theta=500.0, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    assert assert_computes_as_transformers(both).rope_theta == 50000.0
    top = edited(saved, tmp_path / "top", _set(rope_theta=500.0,
                                               rope_parameters={"rope_type": "default"}))
    assert assert_computes_as_transformers(top).rope_theta == 500.0


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "rope_theta": 10000.0}


def test_llama3_scaling_takes_its_original_context_where_transformers_does(saved, tmp_path):
    """Without ``original_max_position_embeddings`` in the dict transformers takes the model's
    context (pdlife took 8,192); a top-level one comes before the dict's."""
    bare = edited(saved, tmp_path / "bare", _set(rope_parameters=LLAMA3))
    scaling = assert_computes_as_transformers(bare).rope_scaling
    assert scaling is not None and scaling.original_max_position == 256
    top = edited(saved, tmp_path / "top", _set(
        original_max_position_embeddings=32,
        rope_parameters=LLAMA3 | {"original_max_position_embeddings": 128}))
    scaling = assert_computes_as_transformers(top).rope_scaling
    assert scaling is not None and scaling.original_max_position == 32
    lacking = edited(saved, tmp_path / "lacking", _set(
        rope_parameters={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_parameters\.low_freq_factor "
                                              r"is missing$"):
        load_checkpoint(lacking)


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_the_defaults_are_those_of_the_installed_transformers(model_type):
    """Each field config.json may leave out defaults as transformers' class for the model type
    defaults it (MistralConfig: 131,072 positions, a window of 4,096, 8 KV heads)."""
    from transformers import CONFIG_MAPPING

    ours = HF_DEFAULTS[model_type]
    cls = CONFIG_MAPPING[model_type]
    theirs = cls(num_attention_heads=16)
    assert cls.__name__ == ours.config_class
    assert theirs.max_position_embeddings == ours.max_position_embeddings
    assert theirs.rms_norm_eps == ours.rms_norm_eps
    assert theirs.num_key_value_heads == (ours.num_key_value_heads or 16)
    assert getattr(theirs, "sliding_window", None) == ours.sliding_window
    assert theirs.rope_parameters["rope_theta"] == ours.rope_theta
    assert theirs.tie_word_embeddings == ours.tie_word_embeddings
    assert theirs.hidden_act == ours.hidden_act


def _mistral(where: Path, *, drop: tuple[str, ...], heads: int = 4, kv_heads: int = 2,
             max_position: int = 8192) -> Path:
    """A tiny Mistral without a window, saved, then ``drop``'s keys taken out of config.json."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=256, max_position_embeddings=max_position,
        sliding_window=None)).save_pretrained(where)
    config = json.loads((where / "config.json").read_text())
    for key in drop:
        config.pop(key)
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_a_mistral_config_without_a_window_has_mistral_config_s_window(tmp_path):
    """transformers gives a Mistral config.json without ``sliding_window`` MistralConfig's
    4,096 (positions from 4,096 on then attend to the last 4,096 only); pdlife served it with
    no window, computing other logits there. Such a Mistral is refused, as one that says its
    window is; so is one that also leaves out its context (MistralConfig's 131,072)."""
    from transformers import AutoConfig

    windowed = _mistral(tmp_path / "windowed", drop=("sliding_window",))
    assert AutoConfig.from_pretrained(windowed).sliding_window == 4096
    with pytest.raises(UnsupportedCheckpoint, match=re.escape(
            f"{windowed}: a Mistral with a sliding window of 4096 tokens (MistralConfig's "
            "default: config.json gives none), shorter than its context of 8192, is not "
            "supported")):
        load_checkpoint(windowed)
    short = _mistral(tmp_path / "short", drop=("sliding_window",), max_position=4096)
    assert assert_computes_as_transformers(short).max_position == 4096
    bare = _mistral(tmp_path / "bare", drop=("sliding_window", "max_position_embeddings"),
                    max_position=4096)
    with pytest.raises(UnsupportedCheckpoint, match="shorter than its context of 131072"):
        load_checkpoint(bare)


def test_a_mistral_config_without_a_context_or_kv_heads_takes_mistral_config_s(tmp_path):
    """MistralConfig's context is 131,072 positions (pdlife took 2,048) and its KV heads 8
    (pdlife took as many as the attention heads, and refused the weights)."""
    where = _mistral(tmp_path / "m", drop=("max_position_embeddings", "num_key_value_heads"),
                     heads=16, kv_heads=8)
    config = json.loads((where / "config.json").read_text())
    assert config["sliding_window"] is None
    read = load_checkpoint(where).config
    assert (read.max_position, read.kv_heads, read.heads) == (131072, 8, 16)
    assert_computes_as_transformers(where)


def test_rope_freqs_compute_as_the_llama3_scaling_they_encode(tmp_path):
    """llama.cpp's converter writes a Llama 3.1's scaling as per-frequency factors
    (``rope_freqs.weight``: the plain inverse frequencies over the scaled ones): the GGUF file
    computes as transformers computes the directory."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_model(rope_parameters=LLAMA3 | {"original_max_position_embeddings": 32})
    hf.save_pretrained(tmp_path / "hf")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    write_tiny_gguf(tmp_path / "m.gguf", hf=hf,
                    extra={"rope_freqs.weight": (plain / scaled).numpy()})
    checkpoint = load_checkpoint(tmp_path / "m.gguf")
    assert checkpoint.config.rope_scaling is None and "rope_freqs" in checkpoint.tensors
    model = RealModel(checkpoint)
    pool = model.make_pool(num_pages=6, page_size=16)
    ours = model.logits(pool, [ForwardItem("t", tuple(LONG_IDS), 0, tuple(range(6)),
                                           all_logits=True)])
    with torch.inference_mode():
        theirs = hf(torch.tensor([LONG_IDS])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_tensor_in_two_safetensors_files_is_refused_naming_both(saved, tmp_path):
    """Without an index every ``*.safetensors`` file is read: a tensor two of them hold (a
    leftover copy beside the weights) was taken from whichever was read last."""
    from safetensors.torch import save_file

    where = edited(saved, tmp_path / "two", lambda config: None)
    save_file({"model.norm.weight": torch.zeros(256)}, str(where / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{where}: tensor 'model.norm.weight' is in two files, extra.safetensors and "
            "model.safetensors: keep one copy of it")):
        load_checkpoint(where)
