"""The real model written as a Hugging Face safetensors folder (what vLLM's CPU build loads, having no GGUF
reader): read back by llminfer it gives the same logits as the GGUF file, its tokenizer encodes like the GGUF
one, and transformers (whose tokenizer and model classes vLLM uses) reads the folder the same way. Chapter 11."""
from __future__ import annotations

import json

import pytest
import torch

import llminfer
from llminfer import gguf_reader

pytestmark = pytest.mark.timeout(600)

SMOLLM2 = "smollm2-135m-instruct"
TEXTS = ["The capital of France is", "naïve café, Ελληνικά, 日本語 🤖🚀", "def f(x):\n\treturn x ** 2\r\n",
         "   runs   of\t\tspaces\n\n", "numbers 3.14159 -42 1e-5", "<|im_start|>user\nhi<|im_end|> spelled as text", ""]
CHAT = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}]


@pytest.fixture(scope="module")
def gguf_model():
    try:
        gguf_reader.installed_gguf(SMOLLM2)
    except FileNotFoundError as exc:          # make test installs it: its absence is a broken setup
        pytest.fail(str(exc))
    return llminfer.load_pretrained(SMOLLM2, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def folder(gguf_model, tmp_path_factory):
    model, tokenizer = gguf_model
    return llminfer.save_pretrained(model, tmp_path_factory.mktemp("smollm2-hf"), tokenizer=tokenizer)


def test_the_folder_has_what_a_hugging_face_loader_reads(folder):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["rope_theta"]) == (30, 576, 100000.0)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    assert (settings["bos_token"], settings["eos_token"], settings["add_bos_token"]) == ("<|im_start|>",
                                                                                         "<|im_end|>", False)
    assert "<|im_start|>" in settings["chat_template"]


def test_read_back_it_gives_the_gguf_files_logits_exactly(gguf_model, folder):
    model, tokenizer = gguf_model
    again, again_tokenizer = llminfer.load_pretrained(folder, device="cpu", dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris, and the capital of Peru is")])
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))
    bf16, _ = llminfer.load_pretrained(folder, device="cpu", dtype=torch.bfloat16)
    direct, _ = llminfer.load_pretrained(SMOLLM2, device="cpu", dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(bf16.state_dict().values(), direct.state_dict().values()))


def test_its_tokenizer_encodes_and_lays_out_chats_like_the_gguf_one(gguf_model, folder):
    _, tokenizer = gguf_model
    again = llminfer.checkpoint.load_tokenizer(folder)
    assert (again.bos_token_id, again.eos_token_id, again.add_bos_token) == (1, 2, False)
    for text in TEXTS:
        assert again.encode(text) == tokenizer.encode(text), text
        assert again.encode(text, allow_special=True) == tokenizer.encode(text, allow_special=True), text
    assert again.apply_chat_template(CHAT) == tokenizer.apply_chat_template(CHAT)
    from llminfer.serve.chat import load_chat_template
    assert load_chat_template(folder).render(CHAT) == tokenizer.apply_chat_template(CHAT, tokenize=False)


def test_transformers_reads_the_folder_as_llminfer_does(gguf_model, folder):
    transformers = pytest.importorskip("transformers")
    model, tokenizer = gguf_model
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert hf_tokenizer.encode(text, add_special_tokens=True) == tokenizer.encode(text, allow_special=True), text
    assert hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert hf_tokenizer.eos_token_id == 2
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("Once upon a time, in a land far away,")])
    with torch.no_grad():
        assert (reference(ids).logits - model(ids)).abs().max().item() < 1e-4
