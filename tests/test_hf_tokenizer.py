"""The checkpoint's tokenizer equals transformers' on text and on chat messages.

pdlife rebuilds SmolLM2's byte-level BPE from the GGUF metadata (and reads a ``tokenizer.json``
directory); transformers builds its own from the same file. Both must give the same ids,
special tokens included, and the chat template must render the same text.
"""

from __future__ import annotations

import json

import pytest
import transformers

from scheduler.model.checkpoint import CheckpointError, TokenizerSource
from scheduler.model.hf_tokenizer import from_gguf_fields, load_tokenizer
from tests.real_prompts import CONVERSATIONS, PROMPTS

TEXTS = (
    *PROMPTS,
    "  two  spaces\n\n\ttab and trailing ",
    "Ünïcödé — emoji 🎉, 中文 and العربية",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "x=3.14159*r**2; print(f'{x:.2f}')  # 1234567890",
    "",
)


def test_text_encodes_as_transformers_does(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    tok = smollm2.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text


def test_special_tokens_stay_whole(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert tok.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 49152)


def test_chat_messages_encode_as_transformers_does(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    tok = smollm2.tokenizer
    for messages in (*CONVERSATIONS, *([{"role": "user", "content": p}] for p in PROMPTS)):
        text = tok.apply_chat_template(messages)
        assert text == hf_tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert tok.encode_chat(messages) == list(expected["input_ids"])
    # The template's default system prompt, and no generation prompt when asked for none.
    plain = tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False)
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert plain.endswith("<|im_end|>\n")


def test_a_tokenizer_json_directory_encodes_the_same(smollm2, hf_smollm2, tmp_path):
    _, hf_tok = hf_smollm2
    hf_tok.save_pretrained(tmp_path)
    tok = load_tokenizer(TokenizerSource(directory=tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == smollm2.tokenizer.encode(text), text
    for messages in CONVERSATIONS:
        assert tok.encode_chat(messages) == smollm2.tokenizer.encode_chat(messages)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))


def test_unsupported_tokenizers_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'bert' is not supported"):
        from_gguf_fields({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match="0 scores for 1 tokens and no merges"):
        from_gguf_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match=r"no tokenizer\.json"):
        load_tokenizer(TokenizerSource(directory=tmp_path))


def test_a_checkpoint_without_a_chat_template_says_so():
    tok = from_gguf_fields({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    })
    assert tok.encode("ab") == [0, 2]  # BOS added, as the file asks
    assert tok.encode("ab", add_special_tokens=False) == [2]
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "ab"}])


WORDS = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<e>", "<t>"],
         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3, 3]}


def test_gguf_pre_tokenizers_are_known_or_refused(caplog):
    with pytest.raises(CheckpointError, match="pre-tokenizer 'tekken'"):
        from_gguf_fields(WORDS | {"tokenizer.ggml.pre": "tekken"})
    tok = from_gguf_fields(WORDS)  # none named: GPT-2's splitting, said at WARNING
    assert "names no pre-tokenizer" in caplog.text
    assert tok.encode("ab ab") == from_gguf_fields(
        WORDS | {"tokenizer.ggml.pre": "gpt-2"}).encode("ab ab")
    # EOS, end of turn and end of message all end an answer.
    tok = from_gguf_fields(WORDS | {"tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.eos_token_id": 3,
                                    "tokenizer.ggml.eot_token_id": 4})
    assert tok.eos_token_ids == (3, 4)


def test_chat_templates_compile_as_they_load(smollm2, tmp_path):
    smollm2.tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    # A training template's {% generation %} block renders its body; chat_template.json (a
    # processor's file, where some checkpoints keep the template) is read too.
    template = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
                "{% endif %}\n{% endfor %}")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(TokenizerSource(directory=tmp_path))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(messages) == "user: hiassistant: yo"  # trim_blocks
    assert tok.apply_chat_template(messages) == transformers.AutoTokenizer.from_pretrained(
        tmp_path).apply_chat_template(messages, tokenize=False, chat_template=template)
    # One that does not compile is the checkpoint's error, found as it loads.
    (tmp_path / "chat_template.jinja").write_text("{% frobnicate %}")
    with pytest.raises(CheckpointError, match="the chat template does not compile"):
        load_tokenizer(TokenizerSource(directory=tmp_path))


def test_tojson_takes_transformers_keywords(smollm2, tmp_path):
    # Templates pass them (GLM's tools: ``tool | tojson(ensure_ascii=False)``).
    smollm2.tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for t in tools %}{{ t | tojson(ensure_ascii=False) }}|"
                "{{ t | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True) }}|"
                "{{ t | tojson(indent=1) }}{% endfor %}{% for m in messages %}{{ m.content }}"
                "{% endfor %}")
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(TokenizerSource(directory=tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"b": 1, "a": 2}}}]
    rendered = tok.apply_chat_template(messages, tools=tools)
    assert "météo" in rendered and "m\\u00e9t\\u00e9o" in rendered
    assert rendered == transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, tools=tools, tokenize=False, chat_template=template)


def _sentencepiece_style(where, **config):
    """A Llama 2-style tokenizer directory: a byte-fallback BPE whose ``tokenizer.json`` has the
    older ``Prepend("▁")`` normalizer, and ``tokenizer_class`` LlamaTokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator([*TEXTS, *PROMPTS] * 5, trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, max_token_length=12))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    saved = json.loads(tok.to_str())  # the trainer made the byte pieces special: they are not
    saved["added_tokens"] = [t for t in saved["added_tokens"] if not t["content"].startswith("<0x")]
    (where / "tokenizer.json").write_text(json.dumps(saved, ensure_ascii=False))
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
                "{{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] | trim }}"
                "{{ eos_token }}{% endif %}{% endfor %}")
    (where / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "tokenizer_class": "LlamaTokenizer", "chat_template": template, **config}))


@pytest.mark.parametrize("config", [{"legacy": False}, {"legacy": True}, {},
                                    {"add_prefix_space": False}])
def test_a_sentencepiece_style_directory_encodes_as_transformers_rebuilds_it(tmp_path, config):
    _sentencepiece_style(tmp_path, **config)
    ours = load_tokenizer(TokenizerSource(directory=tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in (*TEXTS, " leading space", "<s>hi</s> x", " "):
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    for messages in CONVERSATIONS[:3]:
        rendered = theirs.apply_chat_template(messages, add_generation_prompt=True)
        assert ours.encode_chat(messages) == list(rendered["input_ids"])


def test_a_sentencepiece_gguf_tokenizer_encodes_as_transformers_reads_it(tmp_path):
    """``tokenizer.ggml.model`` llama (Llama 2, TinyLlama GGUF files): pieces with scores and no
    merges; the merges the scores imply, byte fallback and BOS, as transformers rebuilds them."""
    import gguf

    _sentencepiece_style(tmp_path)
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x")
             else 1 for t in tokens]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0 if k != 1 else -float(i) for i, k in enumerate(types)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = {name: field.contents()
              for name, field in gguf.GGUFReader(str(tmp_path / "spm.gguf")).fields.items()
              if name.startswith("tokenizer.")}
    ours = from_gguf_fields(fields)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in (*TEXTS, " leading space", "<s>hi</s> x"):
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize(("key", "value"), [
    ("tokenizer.ggml.eos_token_id", "2"),
    ("tokenizer.ggml.eot_token_id", 5),
    ("tokenizer.ggml.bos_token_id", -1),
    ("tokenizer.ggml.eom_token_id", True),
])
def test_a_gguf_token_id_outside_the_vocabulary_is_refused_naming_its_field(key, value):
    with pytest.raises(CheckpointError) as refused:
        from_gguf_fields(WORDS | {key: value})
    assert str(refused.value) == (f"GGUF tokenizer: {key} must be a token id, an integer in "
                                  f"0..4, got {value!r}")
    tok = from_gguf_fields(WORDS | {key: 4})  # the last id of the vocabulary is one
    assert 4 in (tok.bos_token_id, *tok.eos_token_ids)
