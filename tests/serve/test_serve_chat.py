"""Chat templates: the plain one of the bundled model, and a checkpoint's own, rendered as transformers renders it."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

import llminfer
from llminfer.checkpoint import _locate
from llminfer.engine import LLMEngine
from llminfer.serve.chat import PLAIN_TEMPLATE, ChatTemplate, load_chat_template, message_text
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

# A template in the style of real checkpoints: role markers, special tokens, a generation prompt, a loop
# variable, a filter and an error for roles it does not know.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "{{ message['role'] | upper }}: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Answer briefly. "},
            {"role": "user", "content": "The capital of France"},
            {"role": "assistant", "content": "is Paris."},
            {"role": "user", "content": [{"type": "text", "text": "The capital of "}, {"type": "text", "text": "Peru"}]}]


@pytest.fixture(scope="module")
def checkpoint_with_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("templated")
    source = _locate("tiny-capitals")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_plain_template_joins_contents_without_roles():
    template = load_chat_template(_locate("tiny-capitals"))          # tiny-capitals has no chat_template
    assert template.source == PLAIN_TEMPLATE and template.origin == "plain"
    assert template.render([{"role": "user", "content": "The capital of France"}]) == "The capital of France"
    assert template.render([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb"


def test_a_checkpoint_template_renders_as_transformers_renders_it(checkpoint_with_template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint_with_template))
    ours = load_chat_template(checkpoint_with_template)
    assert ours.origin == "tokenizer_config.json"
    plain_messages = [{**m, "content": message_text(m["content"])} for m in MESSAGES]
    for generation_prompt in (True, False):
        expected = hf.apply_chat_template(plain_messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.render(MESSAGES, add_generation_prompt=generation_prompt) == expected
    _, tokenizer = llminfer.load_pretrained(checkpoint_with_template)
    text = ours.render(MESSAGES)
    assert tokenizer.encode(text, allow_special=True) == hf(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="unknown role"):
        ours.render([{"role": "tool", "content": "x"}])


def test_the_server_uses_the_checkpoint_template(checkpoint_with_template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint_with_template))
    model, tokenizer = llminfer.load_pretrained(checkpoint_with_template)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name="templated"),
                         engine=LLMEngine(model, num_blocks=32), model_folder=checkpoint_with_template)
    messages = [{"role": "user", "content": "The capital of France"}]
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_prompt_tokens = len(hf(ids, add_special_tokens=False)["input_ids"])
    with ServerThread(build_app(server=state)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model="templated", messages=messages, max_tokens=3, temperature=0)
        assert response.usage.prompt_tokens == expected_prompt_tokens
        bad = httpx.post(server.url + "/v1/chat/completions",
                         json={"model": "templated", "messages": [{"role": "tool", "content": "x"}]})
        assert bad.status_code == 400 and "unknown role" in bad.json()["error"]["message"]


def test_templates_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ValueError, match="text parts"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}])
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_chat_template(tmp_path)
