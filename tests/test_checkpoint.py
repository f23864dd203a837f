"""Loading real checkpoints: GGUF (several quantization types) and Hugging Face directories.

Tiny Llama models are made with transformers (random weights), written as a Hugging Face
directory (``save_pretrained``) or as a GGUF file (llama.cpp's layout: Q/K rows permuted, types
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q6_K), loaded by pdlife and checked against
transformers computing the same weights. Checkpoints of other architectures are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from scheduler.model.checkpoint import CheckpointError, UnsupportedCheckpoint
from scheduler.model.gguf_checkpoint import permute_rotary_rows, unpermute_rotary_rows
from scheduler.model.hf_tokenizer import from_gguf_fields
from scheduler.model.llama import RealModel
from scheduler.model.loader import load_checkpoint
from scheduler.model.select import load_model
from scheduler.runner import ForwardItem

VOCAB = 96
TYPES = {  # GGUF tensor name part -> its type in the written file
    "token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1,
    "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.BF16, "ffn_up": Q.Q6_K,
    "ffn_down": Q.Q8_0,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_hf_model(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=False,
                  max_position_embeddings=256, rms_norm_eps=1e-5)
    fields.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    with torch.no_grad():  # norms away from 1, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def our_logits(model: RealModel, ids: list[int]) -> torch.Tensor:
    pool = model.make_pool(num_pages=4, page_size=16)
    return model.logits(pool, [ForwardItem("t", tuple(ids), 0, (0, 1, 2, 3))])[0]


IDS = [3, 17, 42, 5, 88, 1, 60, 23, 9, 71]


def test_a_hugging_face_directory_computes_as_transformers(tmp_path):
    hf = tiny_hf_model(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0})
    hf.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.format == "safetensors"
    assert not checkpoint.config.tie_word_embeddings
    assert checkpoint.config.rope_scaling is not None
    assert checkpoint.config.rope_scaling.kind == "llama3"
    ours = our_logits(RealModel(checkpoint), IDS)
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_released_checkpoint_keeps_its_configuration_and_the_model_its_answers(
        tmp_path, dtype):
    """The model holds weights of its own: after ``release_checkpoint`` it computes the same
    logits from none of the checkpoint's tensors; building a shard from them is refused."""
    _with_a_tokenizer(tmp_path)
    served = load_model(str(tmp_path), dtype=dtype)
    config = served.model.checkpoint.config
    before = our_logits(served.model, IDS)
    served.release_checkpoint()
    assert served.model.checkpoint.tensors == {} and served.model.checkpoint.config is config
    assert torch.equal(our_logits(served.model, IDS), before)
    with pytest.raises(RuntimeError, match="tensors were released"):
        served.shard(mesh=None, device="cpu")
    served.release_checkpoint()  # again: nothing to do


def test_released_weights_keep_what_sizes_a_pool_and_refuse_a_forward(tmp_path):
    """A TP rank 0 serves with its part: the whole model's weights go, what sizes its pools
    and names it stays, and a forward on it says why it cannot run."""
    _with_a_tokenizer(tmp_path)
    served = load_model(str(tmp_path))
    before = served.make_pool(num_pages=2, page_size=16).buffer.shape
    served.release_weights()
    assert served.model.checkpoint.tensors == {}
    assert served.make_pool(num_pages=2, page_size=16).buffer.shape == before
    assert served.kv_bytes_per_token == served.model.kv_bytes_per_token
    with pytest.raises(RuntimeError, match="weights were released"):
        our_logits(served.model, IDS)
    reference = load_model("reference")
    reference.release_weights()  # the reference model keeps its few KiB
    assert reference.generate([3, 5], 2, ignore_eos=True)


def test_tied_heads_and_linear_rope_scaling_load_from_a_directory(tmp_path):
    hf = tiny_hf_model(tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    hf.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.config.tie_word_embeddings and "lm_head" not in checkpoint.tensors
    ours = our_logits(RealModel(checkpoint), IDS)
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def _q6_k_bytes(rows: int, cols: int) -> np.ndarray:
    """Random but well-formed Q6_K blocks (``gguf`` cannot quantize K-quants, only read them)."""
    rng = np.random.default_rng(0)
    blocks = np.zeros((rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, :192] = rng.integers(0, 256, (blocks.shape[0], 192))
    blocks[:, 192:208] = rng.integers(-8, 9, (blocks.shape[0], 16)).astype(np.int8).view(np.uint8)
    blocks[:, 208:210] = np.full((blocks.shape[0], 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, hf, *, architecture: str = "llama") -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["t 1"])
    for name, tensor in hf.state_dict().items():
        gguf_name, kind = _gguf_name(name)
        data = tensor.float().numpy()
        if kind == "attn_q":
            data = permute_rotary_rows(tensor.float(), c.num_attention_heads).numpy()
        elif kind == "attn_k":
            data = permute_rotary_rows(tensor.float(), c.num_key_value_heads).numpy()
        qtype = TYPES.get(kind, Q.F32)
        if qtype == Q.Q6_K:
            w.add_tensor(gguf_name, _q6_k_bytes(*data.shape), raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(gguf_name, data)
        else:
            w.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_name(hf_name: str) -> tuple[str, str]:
    base = hf_name.removesuffix(".weight")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.weight", top[base]
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[part]}.weight", HF_TO_GGUF[part]


def test_a_quantized_gguf_computes_as_transformers_reading_it(tmp_path):
    from transformers import AutoModelForCausalLM

    write_gguf(tmp_path / "tiny.gguf", tiny_hf_model())
    checkpoint = load_checkpoint(tmp_path / "tiny.gguf")
    assert checkpoint.format == "gguf" and not checkpoint.config.tie_word_embeddings
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ours = our_logits(RealModel(checkpoint), IDS)
    torch.testing.assert_close(ours, hf_logits(reference, IDS), atol=1e-4, rtol=1e-4)


def test_the_rotary_permutation_round_trips():
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    assert torch.equal(unpermute_rotary_rows(permute_rotary_rows(w, 4), 4), w)
    assert not torch.equal(permute_rotary_rows(w, 4), w)


def test_other_architectures_are_refused_by_name(tmp_path):
    hf = tiny_hf_model()
    write_gguf(tmp_path / "qwen.gguf", hf, architecture="qwen2")
    with pytest.raises(UnsupportedCheckpoint, match="'qwen2'"):
        load_checkpoint(tmp_path / "qwen.gguf")
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedCheckpoint, match="'gpt2'"):
        load_checkpoint(directory)
    (directory / "config.json").write_text("{}")  # it said "the architecture is None"
    with pytest.raises(UnsupportedCheckpoint, match="does not say its architecture "
                                                    r"\(no model_type in config\.json"):
        load_checkpoint(directory)


def test_a_name_pdlife_does_not_know_is_said_to_be_one() -> None:
    """A misspelt model name read as a missing path, and "" as the current directory."""
    with pytest.raises(CheckpointError, match=r"^smollm3: no such file or directory, and not a "
                                              r"model pdlife knows by name \(reference, "
                                              r"smollm2\)$"):
        load_model("smollm3")
    with pytest.raises(CheckpointError, match=r"^no model named: give 'reference'"):
        load_model("")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there: the device is valid")
def test_a_cuda_device_without_cuda_is_refused_before_any_forward() -> None:
    from scheduler.model.decoder import resolve_device

    with pytest.raises(ValueError, match=r"^device 'cuda': this torch \(.*\) (has no CUDA "
                                         r"build|finds no CUDA device); use device 'cpu' or "
                                         r"'auto'"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_missing_or_broken_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "absent.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"not a \.gguf file"):
        load_checkpoint(tmp_path / "notes.txt")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_checkpoint(tmp_path / "bad.gguf")
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(CheckpointError,
                       match=r"'model\.layers\.2\.input_layernorm\.weight' is missing"):
        load_checkpoint(tmp_path / "hf")
    write_gguf(tmp_path / "cut.gguf", hf)
    whole = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "cut.gguf")


def test_fingerprints_tell_checkpoints_apart(tmp_path):
    tiny_hf_model().save_pretrained(tmp_path / "a")
    tiny_hf_model(rms_norm_eps=1e-6).save_pretrained(tmp_path / "b")
    a, a_again = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "a")
    assert a.fingerprint == a_again.fingerprint
    assert a.fingerprint != load_checkpoint(tmp_path / "b").fingerprint


def test_one_weight_element_changes_the_fingerprint(tmp_path):
    """The fingerprint decides whether two pools exchange KV: it covers every element, not a
    sample (a sample of every 16th element of a 256 x 256 weight missed this one), in a
    directory and in a GGUF file."""
    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path / "a")
    write_gguf(tmp_path / "a.gguf", hf)
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[0, 1] += 0.5
        hf.model.embed_tokens.weight[5, 1] += 0.5
    hf.save_pretrained(tmp_path / "b")
    write_gguf(tmp_path / "b.gguf", hf)
    for a, b in [("a", "b"), ("a.gguf", "b.gguf")]:
        first, second = load_checkpoint(tmp_path / a), load_checkpoint(tmp_path / b)
        assert first.config == second.config
        assert first.fingerprint != second.fingerprint, (a, b)
        assert first.fingerprint == load_checkpoint(tmp_path / a).fingerprint


def _with_a_tokenizer(where: Path) -> None:
    """A tiny model's directory with a word-level tokenizer.json (``t0``, ``t1``, ...)."""
    tiny_hf_model().save_pretrained(where)
    words = from_gguf_fields({"tokenizer.ggml.model": "gpt2",
                              "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]})
    words.tokenizer.save(str(where / "tokenizer.json"))


def test_model_selection_names_the_reference_and_paths(tmp_path):
    _with_a_tokenizer(tmp_path)
    served = load_model(str(tmp_path), dtype="bfloat16")
    assert not served.is_reference and served.max_position == 256
    assert served.generate([3, 5], 2, ignore_eos=True)[0] in range(VOCAB)
    pool = served.make_pool(num_pages=2, page_size=16)
    assert pool.dtype == torch.bfloat16 and pool.num_layers == 2
    assert served.pages_for(2 * 16 * served.kv_bytes_per_token, 16) == 2
    reference = load_model("reference")
    assert reference.is_reference and reference.fingerprint.startswith("reference-")
    assert reference.decode(reference.generate(reference.encode("hi"), 3)) is not None


def test_pools_of_different_models_refuse_to_exchange_pages(tmp_path):
    from kv.local import LocalKVManager, LocalTransferHub
    from kv.local_decode import LocalDecodeManager
    from kv.metadata import MetadataBuffers
    from kv.pool import KVGeometryError

    tiny_hf_model().save_pretrained(tmp_path / "a")
    tiny_hf_model(rms_norm_eps=1e-6).save_pretrained(tmp_path / "b")
    a, b = RealModel(load_checkpoint(tmp_path / "a")), RealModel(load_checkpoint(tmp_path / "b"))
    pool_a = a.make_pool(num_pages=4, page_size=16)
    pool_b = b.make_pool(num_pages=4, page_size=16)
    assert pool_a.geometry.mismatches(a.make_pool(num_pages=8, page_size=16).geometry) == []
    assert [m.split(":")[0] for m in pool_a.geometry.mismatches(pool_b.geometry)] == ["model"]
    hub = LocalTransferHub()
    prefill = LocalKVManager(pool_a, MetadataBuffers(2), hub=hub, bootstrap_addr="local:0")
    decode = LocalDecodeManager(pool_b, MetadataBuffers(2), hub=hub)
    try:
        receiver = decode.create_receiver("local:0", 1)
        with pytest.raises(KVGeometryError, match="model: "):
            receiver.init()
    finally:
        prefill.close()
        close = getattr(decode, "close", None)
        if close is not None:
            close()


def test_a_mistral_without_a_sliding_window_computes_as_transformers(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**fields, sliding_window=None)).eval()
    hf.save_pretrained(tmp_path / "open")
    ours = our_logits(RealModel(load_checkpoint(tmp_path / "open")), IDS)
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    MistralForCausalLM(MistralConfig(**fields, sliding_window=64)).save_pretrained(
        tmp_path / "windowed")
    with pytest.raises(UnsupportedCheckpoint, match="sliding window of 64 tokens"):
        load_checkpoint(tmp_path / "windowed")


def test_a_directory_reads_the_files_its_index_names_and_skips_rotary_buffers(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    first = load_file(str(tmp_path / shards[0]))  # an older checkpoint's rotary buffer
    save_file(first | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)},
              str(tmp_path / shards[0]), metadata={"format": "pt"})
    # A copy in another layout beside the shards (as some repositories hold).
    save_file({"tok_embeddings.weight": torch.zeros(VOCAB, 256)},
              str(tmp_path / "consolidated.safetensors"))
    ours = our_logits(RealModel(load_checkpoint(tmp_path)), IDS)
    torch.testing.assert_close(ours, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    save_file({"model.norm.weight": torch.ones(256, dtype=torch.int8)},
              str(tmp_path / shards[-1]), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpoint, match=r"'model\.norm\.weight' is int8"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(UnsupportedCheckpoint,
                       match=r"consolidated\.safetensors: tensor 'tok_embeddings\.weight'"):
        load_checkpoint(tmp_path)


def test_eos_ids_come_from_the_generation_config_else_config_json(tmp_path, caplog):
    from scheduler.assemble import constraint_compiler

    words = from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                              "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]})
    hf = tiny_hf_model(eos_token_id=7)
    hf.generation_config.eos_token_id = [5, 6]
    hf.save_pretrained(tmp_path)
    words.tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_model(str(tmp_path)).eos_token_ids == (5, 6)
    (tmp_path / "generation_config.json").unlink()
    served = load_model(str(tmp_path) + "/")
    assert (served.eos_token_ids, served.name) == ((7,), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
    served = load_model(str(tmp_path))
    assert served.eos_token_ids == ()
    assert "no EOS id" in caplog.text
    # No EOS for a grammar to end on: the server runs without structured output.
    assert constraint_compiler(served) is None
    assert "structured output is off" in caplog.text
