"""What a user who brings their own checkpoint meets: files read as transformers reads them, and
every problem with the files or the flags said in one line (exit status 2), naming the file.

The checkpoints are tiny random Llamas written by transformers (``save_pretrained``), then
edited or damaged the way users' files are.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from scheduler.model.checkpoint import CheckpointError, UnsupportedCheckpoint
from scheduler.model.hf_tokenizer import from_gguf_fields
from scheduler.model.llama import RealModel, generate
from scheduler.model.loader import load_checkpoint
from scheduler.model.select import load_model
from tests.test_checkpoint import IDS, VOCAB, tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent


def tiny_directory(where: Path, **overrides: object) -> Path:
    """A tiny random Llama as ``save_pretrained`` writes it, with a tokenizer.json."""
    tiny_hf_model(**overrides).save_pretrained(where)
    words = from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                              "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]})
    words.tokenizer.save(str(where / "tokenizer.json"))
    return where


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What ``pdlife ARGV`` says on stderr as it exits 2 (one line, no traceback)."""
    from scheduler.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and "\n" not in err[:-1] and "Traceback" not in err, err
    return err


def refused_by_both(capsys: pytest.CaptureFixture[str], model: str) -> str:
    """The line ``pdlife generate`` and ``pdlife serve`` both print for ``--model MODEL``."""
    said = refused(capsys, "generate", "--model", model, "--input-ids", "1,2")
    assert said.startswith("pdlife generate: ")
    served = refused(capsys, "serve", "--backend", "local", "--model", model)
    assert served == said.replace("pdlife generate: ", "pdlife serve: ", 1)
    return said.removeprefix("pdlife generate: ")


def test_a_tie_the_files_contradict_is_overridden_as_transformers_does(tmp_path, caplog):
    """config.json ties the head, the safetensors hold an lm_head.weight of its own:
    transformers (5.x) uses the file's head, and pdlife's tokens are transformers' tokens."""
    from transformers import AutoModelForCausalLM

    tiny_hf_model(tie_word_embeddings=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # not tied
    hf.generation_config.eos_token_id = None  # greedy for the whole length, as --ignore-eos
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([IDS]), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)[0, len(IDS):].tolist()
    with caplog.at_level(logging.WARNING, logger="scheduler.model.loader"):
        checkpoint = load_checkpoint(tmp_path)
    assert not checkpoint.config.tie_word_embeddings and "lm_head" in checkpoint.tensors
    assert "lm_head.weight that differs" in caplog.text and "tie_word_embeddings" in caplog.text
    ours = generate(RealModel(checkpoint), IDS, 12, ignore_eos=True)
    assert ours == theirs
    # The tied head (the embeddings) computes other tokens: the override is what matches.
    tied = dict(checkpoint.tensors)
    del tied["lm_head"]
    tied_checkpoint = attrs.evolve(
        checkpoint, tensors=tied, config=attrs.evolve(checkpoint.config,
                                                      tie_word_embeddings=True))
    assert generate(RealModel(tied_checkpoint), IDS, 12, ignore_eos=True) != theirs


def test_damaged_files_are_one_line_naming_the_file(tmp_path, capsys):
    model = tiny_directory(tmp_path / "cut")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # head -c 1000
    said = refused_by_both(capsys, str(model))
    assert said.startswith(f"{weights}: not a readable safetensors file, damaged or truncated")
    words = tiny_directory(tmp_path / "words")
    (words / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    said = refused_by_both(capsys, str(words))
    assert said.startswith(f"{words / 'tokenizer.json'}: not a tokenizer the tokenizers library "
                           "reads, damaged or truncated")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json",
                                  "generation_config.json", "model.safetensors.index.json"])
def test_json_that_does_not_parse_is_named_by_its_path(tmp_path, name):
    model = tiny_directory(tmp_path)
    (model / name).write_text('{model_type: "llama"}')
    with pytest.raises(CheckpointError) as info:
        load_model(str(model))
    assert str(info.value).startswith(f"{model / name}: not valid JSON (Expecting property "
                                      "name enclosed in double quotes: line 1 column 2")


def test_a_built_in_name_comes_before_a_directory_with_a_warning(tmp_path, monkeypatch,
                                                                  caplog):
    tiny_directory(tmp_path / "reference")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="scheduler.model.select"):
        assert load_model("reference").is_reference
    assert str(tmp_path / "reference") in caplog.text and "pass ./reference" in caplog.text
    caplog.clear()
    served = load_model("./reference")
    assert not served.is_reference and "built-in" not in caplog.text
    # The name another process loads it again from is the directory, not the built-in model.
    assert served.source == ("./reference", "float32")
    assert load_model(served.source[0]).fingerprint == served.fingerprint


def test_generate_refuses_an_unknown_device_as_serve_does(capsys):
    said = refused(capsys, "generate", "--prompt", "hi", "--device", "gpu")
    served = refused(capsys, "serve", "--backend", "local", "--device", "gpu")
    assert said == ("pdlife generate: --device: device 'gpu' is not a device torch knows: use "
                    "'cpu', 'cuda', 'cuda:N' or 'auto' (--device on the command line)\n")
    assert served == said.replace("pdlife generate: ", "pdlife serve: ", 1)


def test_a_directory_of_pytorch_pickles_says_how_to_convert_it(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf_model()
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=(
            r": no \*\.safetensors files; it holds pytorch_model\.bin, and pdlife reads "
            r"safetensors or GGUF, not PyTorch pickles: convert it with transformers, "
            r"AutoModelForCausalLM\.from_pretrained\(DIR\)\.save_pretrained\(DIR\)")):
        load_checkpoint(tmp_path)
    # The advice works.
    AutoModelForCausalLM.from_pretrained(tmp_path).save_pretrained(tmp_path)
    converted = load_checkpoint(tmp_path)
    assert torch.equal(converted.tensors["layers.1.down"], hf.model.layers[1].mlp.down_proj.weight)


def test_a_directory_without_tokenizer_json_points_to_the_fix(tmp_path):
    tiny_hf_model().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load_model(str(tmp_path))
    assert str(info.value) == (
        f"{tmp_path}: no tokenizer.json, where pdlife reads a directory's tokenizer from: write "
        "one with transformers, AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) (it "
        "converts a tokenizer.model), or, for a directory without tokenizer files, see "
        "docs/models.md, 'Your own checkpoint'")
    assert "Your own checkpoint" in (Path(__file__).parent.parent / "docs" / "models.md"
                                     ).read_text()


def test_encode_given_messages_names_encode_messages(tmp_path):
    model = tiny_directory(tmp_path)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    messages = [{"role": "system", "content": "t1"}, {"role": "user", "content": "t2"}]
    for served in (load_model(str(model)), load_model("reference")):
        with pytest.raises(TypeError, match=r"encode takes one text \(str\), got list: for a "
                                            r"list of chat messages .* call "
                                            r"encode_messages\(messages\)"):
            served.encode(messages, chat=True)  # type: ignore[arg-type]
    served = load_model(str(model))
    assert served.encode_messages(messages[1:]) == served.encode("t2", chat=True)
    assert served.encode_messages(messages) == served.tokenizer.encode(
        "system: t1\nuser: t2\n", add_special_tokens=False)


def test_a_llama_under_another_head_is_said_to_be_no_causal_language_model(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, num_labels=2)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedCheckpoint) as info:
        load_checkpoint(tmp_path)
    assert str(info.value) == (
        f"{tmp_path}: the checkpoint is a LlamaForSequenceClassification (config.json's "
        "architectures), not a causal language model; pdlife serves *ForCausalLM checkpoints")


def test_model_info_reports_the_path_and_v1_models_the_served_name(tmp_path):
    from scheduler.service.config import ServeConfig
    from tests.service_harness import asgi_client, run, running_service

    model = tiny_directory(tmp_path / "mine")
    config = ServeConfig(role="both", backend="local", served=load_model(str(model)),
                         model_name="tiny", pool_pages=16, metadata_slots=4)

    async def main() -> None:
        with running_service(config) as service:
            async with asgi_client(service) as client:
                for path in ("/model_info", "/get_model_info"):
                    info = (await client.get(path)).json()
                    assert (info["model_path"], info["tokenizer_path"]) == (str(model),
                                                                            str(model))
                server = (await client.get("/server_info")).json()
                assert server["model_path"] == str(model)
                models = (await client.get("/v1/models")).json()
                assert [card["id"] for card in models["data"]] == ["tiny"]

    run(main())


def test_bench_model_compares_ones_own_checkpoint_with_transformers(
    smollm2: Any, tmp_path: Path
) -> None:
    """``python -m bench.model --model DIR``: pdlife against transformers on a checkpoint of
    one's own (a tiny random Llama with SmolLM2's tokenizer, for the benchmark's text)."""
    where = tmp_path / "mine"
    tiny_hf_model(vocab_size=smollm2.vocab_size, hidden_size=64, intermediate_size=64,
                  max_position_embeddings=128).save_pretrained(where)
    smollm2.tokenizer.tokenizer.save(str(where / "tokenizer.json"))
    done = subprocess.run(
        [sys.executable, "-m", "bench.model", "--model", str(where), "--prompts", "2",
         "--min-len", "8", "--max-len", "32", "--decode-steps", "2", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{where} fp32, 1 threads"), done.stdout
    result = done.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT model prefill_ratio="), result
    assert float(result.rsplit("max_logit_diff=", 1)[1]) < 1e-3, result
    refused = subprocess.run(
        [sys.executable, "-m", "bench.model", "--model", str(where), "--max-len", "1024"],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert refused.returncode == 2 and f"--max-len 1024: {where} holds 128 positions" in (
        refused.stderr), refused.stderr
