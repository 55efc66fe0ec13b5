"""Chat templates: zoo's rendering equals transformers' apply_chat_template(tokenize=False) on
templates of the common families (written here, in the style of each), with and without a
system message and the generation prompt; segments cut the render into the assistant's pieces
exactly; templates come from a folder as transformers finds them; bad templates and bad
conversations are refused with the template's origin named."""

import json

import pytest

from zoo.text.chat_template import FALLBACK_TEMPLATE, ChatTemplate, ChatTemplateError
from zoo.text.tokenizers import Tokenizer

BOS, EOS = "<|bos|>", "<|eos|>"  # zoo's byte-level tokenizer's, which the reference tokenizer below has

# Llama 3: a header per turn, content trimmed, BOS before the first turn.
LLAMA3 = """
{%- for message in messages %}
    {%- set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' %}
    {%- set turn = header + message['content'] | trim + '<|eot_id|>' %}
    {%- if loop.first %}
        {%- set turn = bos_token + turn %}
    {%- endif %}
    {{- turn }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# ChatML as SmolLM writes it (on one line: a newline after }} would be output), with a default
# system prompt when the conversation has none.
CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a small, helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Mistral: [INST] ... [/INST] around user turns, roles must alternate, a system message goes
# in front of the first user turn.
MISTRAL = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] + '\\n\\n' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only system, user and assistant roles are supported') }}
    {%- endif %}
{%- endfor %}"""

# Zephyr: <|role|> lines, EOS ending every turn; the newlines after }} are kept (trim_blocks
# only eats the newline after a block tag).
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n' + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

# Llama 2: the system prompt is folded into the first user turn between <<SYS>> markers.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}"
          "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
          "{% for message in loop_messages %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")

# Gemma: no system role (raises), the assistant is "model".
GEMMA = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- raise_exception('System role not supported') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"""

# What each template makes of an assistant message: its piece in segments().
ASSISTANT_PIECE = {
    "llama3": lambda c: c.strip() + "<|eot_id|>",
    "chatml": lambda c: c + "<|im_end|>\n",
    "mistral": lambda c: c + EOS,
    "zephyr": lambda c: c + EOS + "\n",
    "llama2": lambda c: " " + c.strip() + " " + EOS,
    "gemma": lambda c: c.strip() + "<end_of_turn>\n",
}
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL, "zephyr": ZEPHYR, "llama2": LLAMA2,
             "gemma": GEMMA}
HAS_SYSTEM = {"llama3", "chatml", "mistral", "zephyr", "llama2"}

SYSTEM = {"role": "system", "content": "Answer in one short sentence. Réponds en français si on te parle français."}
CHAT = [
    {"role": "user", "content": "  What is the capital of France?\n"},
    {"role": "assistant", "content": "Paris — ville lumière. "},
    {"role": "user", "content": "И столица Японии? 日本の首都は？ 🙂"},
    {"role": "assistant", "content": "東京 (Tokyo).\n\n  def f(): return {'a': 1}"},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' tokenizer for zoo's byte-level tokenizer (bos <|bos|>, eos <|eos|>)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("bytes")
    Tokenizer.byte_level().save(folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def conversations(name):
    """Conversations ending on an assistant and on a user turn, with a system message where the
    template takes one."""
    for system in ([], [SYSTEM]) if name in HAS_SYSTEM else ([],):
        yield system + CHAT
        yield system + CHAT[:3]


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_equals_transformers(reference, name):
    template = ChatTemplate(TEMPLATES[name], f"test {name}", BOS, EOS)
    for messages in conversations(name):
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=False,
                                                     add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == expected, (messages, prompt)


@pytest.mark.parametrize("name", TEMPLATES)
def test_segments_mark_the_assistant_pieces(name):
    template = ChatTemplate(TEMPLATES[name], f"test {name}", BOS, EOS)
    for messages in conversations(name):
        pieces = template.segments(messages)
        assert "".join(text for text, _ in pieces) == template.render(messages)
        assistant = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [text for text, mine in pieces if mine] == [ASSISTANT_PIECE[name](c) for c in assistant]
        # The rest holds every other message and no assistant text (the header is not the assistant's).
        rest = "".join(text for text, mine in pieces if not mine)
        assert all(c.strip() not in rest for c in assistant)
        assert all(m["content"].strip() in rest for m in messages if m["role"] == "user")


def test_fallback_template():
    template = ChatTemplate(FALLBACK_TEMPLATE, "fallback", BOS, EOS)
    messages = [SYSTEM] + CHAT
    text = template.render(messages)
    assert text.startswith(BOS + "<|im_start|>system\n") and text.endswith(CHAT[-1]["content"] + EOS)
    assert template.render(CHAT[:1], add_generation_prompt=True).endswith(EOS + "<|im_start|>assistant\n")
    assert [t for t, mine in template.segments(messages) if mine] == [c["content"] + EOS for c in CHAT[1::2]]
    # BOS where zoo starts documents with it: not when it is also the EOS (GPT-2's <|endoftext|>).
    assert not ChatTemplate(FALLBACK_TEMPLATE, "fallback", EOS, EOS).render(CHAT).startswith(EOS)
    with pytest.raises(ChatTemplateError, match="fallback: rendering: this template needs an eos_token"):
        ChatTemplate(FALLBACK_TEMPLATE, "fallback").render(CHAT)


def test_template_features_as_transformers(reference):
    """tojson (non-ASCII kept, indent, sort_keys), namespace, loop controls, strftime_now,
    {% generation %}, extra variables, tools/documents seen as none, and indented block tags
    (lstrip_blocks)."""
    source = """{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {{- ns.count ~ ' ' ~ (message | tojson) ~ '\\n' }}
    {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}
    {%- if ns.count == 3 %}{% break %}{% endif %}
{%- endfor %}
    {% if ns.count > 0 %}
counted
    {% endif %}
{{- {'clé': 'über', 'n': [1, 2]} | tojson(indent=2, sort_keys=true) }}
{{- strftime_now('%Y') | length }}{{ tools is none }}{{ documents is none }} {{ user_name | default('?') }}"""
    template = ChatTemplate(source, "features", BOS, EOS)
    messages = [SYSTEM] + CHAT
    for extra in ({}, {"user_name": "Zoë"}):
        expected = reference.apply_chat_template(messages, chat_template=source, tokenize=False, **extra)
        assert template.render(messages, **extra) == expected
    assert '"clé": "über"' in template.render(messages)


def test_not_prefix_stable_is_refused():
    # The number of messages up front: every prefix renders differently from the whole.
    counted = ("{{ messages | length }} messages\n"
               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    template = ChatTemplate(counted, "counted")
    assert template.render(CHAT).startswith("4 messages")
    with pytest.raises(ChatTemplateError, match=r"counted: the template is not prefix-stable at message 1"):
        template.segments(CHAT)


def test_bad_conversations_and_templates():
    template = ChatTemplate(CHATML, "DIR/tokenizer_config.json chat_template", BOS, EOS)
    with pytest.raises(ChatTemplateError, match=r"^DIR/tokenizer_config\.json chat_template: message 2: role "
                                                r"'tool' is not one of system, user, assistant"):
        template.render(CHAT[:2] + [{"role": "tool", "content": "42"}])
    with pytest.raises(ChatTemplateError, match="message 0: role missing"):
        template.segments([{"content": "hi"}])
    with pytest.raises(ChatTemplateError, match=r"message 1 \(assistant\): content is a list, not text"):
        template.render([CHAT[0], {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}])
    with pytest.raises(ChatTemplateError, match="message 0 is a str"):
        template.render(["hello"])
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        template.render({"role": "user", "content": "hi"})

    mistral = ChatTemplate(MISTRAL, "mistral origin", BOS, EOS)
    with pytest.raises(ChatTemplateError, match="^mistral origin: rendering: Conversation roles must alternate"):
        mistral.render([CHAT[0], CHAT[0]])
    with pytest.raises(ChatTemplateError, match="^gemma origin: .*System role not supported"):
        ChatTemplate(GEMMA, "gemma origin", BOS, EOS).segments([SYSTEM] + CHAT)

    with pytest.raises(ChatTemplateError, match=r"^broken: template syntax error at line 2: .*endfor"):
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }}", "broken")
    with pytest.raises(ChatTemplateError, match=r"^adds: rendering: TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}", "adds").render(CHAT)
    with pytest.raises(ChatTemplateError, match=r"^escape: rendering: .*"):  # the sandbox holds
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "escape").render(CHAT)
    with pytest.raises(ChatTemplateError, match=r"^ns: rendering: .*'_secret'"):
        ChatTemplate("{% set ns = namespace(_secret=1) %}{{ ns }}", "ns").render(CHAT)


def test_for_folder_finds_what_transformers_finds(tmp_path):
    transformers = pytest.importorskip("transformers")
    messages = [SYSTEM] + CHAT[:3]

    def same_as_transformers(folder):
        template = ChatTemplate.for_folder(folder)
        reference = transformers.AutoTokenizer.from_pretrained(str(folder))
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == expected
        return template

    folder = tmp_path / "string"
    Tokenizer.byte_level().save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LLAMA3}))
    template = same_as_transformers(folder)
    assert template.origin == f"{folder}/tokenizer_config.json chat_template"
    assert (template.bos_token, template.eos_token) == (BOS, EOS)

    named = tmp_path / "named"
    Tokenizer.byte_level().save(named)
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [
        {"name": "tool_use", "template": ZEPHYR}, {"name": "default", "template": CHATML}]}))
    template = same_as_transformers(named)
    assert template.source == CHATML and template.origin.endswith("chat_template 'default'")

    (folder / "chat_template.jinja").write_text(ZEPHYR)  # wins over tokenizer_config.json's
    template = same_as_transformers(folder)
    assert template.source == ZEPHYR and template.origin == f"{folder}/chat_template.jinja"

    bare = tmp_path / "bare"
    Tokenizer.byte_level().save(bare)
    template = ChatTemplate.for_folder(bare)
    assert template.source == FALLBACK_TEMPLATE and "fallback" in template.origin and str(bare) in template.origin
    assert template.render(CHAT).startswith(BOS)

    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [
        {"name": "tool_use", "template": ZEPHYR}]}))
    with pytest.raises(ChatTemplateError, match=r"named/tokenizer_config\.json chat_template: no template named "
                                                r"'default' among \['tool_use'\]"):
        ChatTemplate.for_folder(named)
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 7}))
    with pytest.raises(ChatTemplateError, match="the template is a int, not text"):
        ChatTemplate.for_folder(named)
