"""Tokenizers and chat templates of the families zoo adds (issues 28 and 29): Qwen2/2.5/3,
Mistral, OLMo-2, SmolLM3, Granite, Gemma 1/2/3, Phi-3, GPT-NeoX/Pythia.

No real tokenizer file can be downloaded here, so each family's tokenizer.json is rebuilt with
the `tokenizers` library as the published file is made (normalizer, pre-tokenizer, model
settings, decoder, post-processor, added tokens and their flags), over a small BPE trained here
on a multi-script corpus, and saved as a checkpoint folder with the family's tokenizer_config.json.
zoo's ids must be the library's on a multi-script sample (and decode back to the text); the
chat templates are the published ones, rendered as transformers renders them, with the loss
mask on exactly the assistant's turns.

What each published tokenizer.json holds (the facts these builders carry over):
  Qwen2/2.5/3      NFC; Split(Qwen's regex: single digits, Isolated) then ByteLevel(use_regex
                   false); ByteLevel post-processor and decoder; <|endoftext|> <|im_start|>
                   <|im_end|> special, <tool_call> / <think> (Qwen3) added but not special
  OLMo-2, SmolLM3  no normalizer; Split(cl100k / Llama-3 regex, digits in threes) then ByteLevel
  Granite 3        Digits(individual) then ByteLevel(use_regex true); <|end_of_text|> is bos/eos
  GPT-NeoX/Pythia  NFC; ByteLevel(add_prefix_space false); runs of 2..24 spaces as added tokens,
                   normalized, not special
  Mistral v0.3     BPE with byte_fallback (<0xNN> tokens), fuse_unk; normalizer Prepend("▁") +
                   Replace(" ", "▁"), no pre-tokenizer (the newer form: no normalizer, Metaspace
                   pre-tokenizer prepend_scheme first, split false); <s> template post-processor
  Gemma            BPE with byte_fallback; normalizer Replace(" ", "▁") and nothing prepended;
                   pre-tokenizer Split(" ", MergedWithPrevious) (finds no space after that) or
                   none; <bos> template post-processor; <start_of_turn> <end_of_turn> special
  Phi-3            Llama-2's kind (as Mistral's first form) with <|assistant|> <|end|> <|user|>
                   ... added with rstrip true (they take the whitespace after them)
"""

import json
import unicodedata
from pathlib import Path

import pytest
from helpers import SHAKESPEARE
from zoo.train.config import DEMO_DATA

from zoo.core.errors import CheckpointError
from zoo.text.chat_template import ChatTemplate, ChatTemplateError
from zoo.text.tokenizers import Tokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SPACE = "\u2581"
# English, accented Latin (composed and decomposed), Cyrillic, Chinese, Japanese, Korean, Arabic,
# Hindi, emoji (with modifiers and a flag), digit runs, code with tabs, newlines and space runs.
SAMPLE = ("Hello   world!! It's 12345 or 3.14159, isn't it? 2024-01-01 x42y\n\n\tTabs\t\there  \n"
          "Grüße aus Köln — Ünïcödé and Cafe\u0301 (decomposed); naïve façade\n"
          "Съешь же ещё этих мягких французских булок; 日本語のテキストです。中文字符测试\n"
          "한국어 텍스트; العربية; हिन्दी; emoji 🙂🚀👍🏽 and 🇫🇷 flags\n"
          "def f(x):\n    if x:\n\t\treturn {'a': [1, 2, 3]}  # comment\n\n\n    pass   \n"
          "trailing   ")
# Characters the corpus below lacks: byte fallback (SentencePiece-style) or unseen bytes (byte-level).
RARE = "ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦜 ∮ ⅷ ௵"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> list[str]:
    # The shared Shakespeare, else zoo's own demo texts: varied English either way (a repeated
    # line would train merges into pieces longer than SentencePiece takes).
    text = SHAKESPEARE.read_text()[:60_000] if SHAKESPEARE.is_file() else "\n\n".join(
        p.read_text() for p in sorted(DEMO_DATA.iterdir()))[:60_000]
    paragraphs = [p + "\n\n" for p in text.split("\n\n")]
    return paragraphs + [SAMPLE] * 20


def _save(folder: Path, tok, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


# --- byte-level families ------------------------------------------------------------------


def _byte_level(folder: Path, *, normalizer, pre_tokenizer, specials: list[str], config: dict,
                plain: list[AddedToken] = ()) -> tuple:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    if plain:
        tok.add_tokens(list(plain))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok, _save(folder, tok, config)


def qwen2(folder: Path):
    """Qwen2.5 / Qwen3: ChatML specials; <tool_call> and Qwen3's <think> added, not special."""
    plain = [AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>", "<think>",
                                                                       "</think>")]
    return _byte_level(folder, normalizer=normalizers.NFC(), pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]),
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], plain=plain,
        config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": QWEN25_TEMPLATE})


def olmo2(folder: Path):
    """OLMo-2 (and SmolLM3, Granite 4: the same cl100k / Llama-3 regex)."""
    return _byte_level(folder, normalizer=None, pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]),
        specials=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>"})


def granite(folder: Path):
    """Granite 3: every digit alone, then GPT-2's regex."""
    return _byte_level(folder, normalizer=None, pre_tokenizer=pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]),
        specials=["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"],
        config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"})


def neox(folder: Path):
    """GPT-NeoX / Pythia: runs of 2..24 spaces are added tokens, normalized and not special."""
    spaces = [AddedToken(" " * n, normalized=True, special=False) for n in range(24, 1, -1)]
    return _byte_level(folder, normalizer=normalizers.NFC(),
                       pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True),
                       specials=["<|endoftext|>", "<|padding|>"], plain=spaces,
                       config={"tokenizer_class": "GPTNeoXTokenizer", "bos_token": "<|endoftext|>",
                               "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"})


# --- SentencePiece-style families (byte fallback, "▁" for spaces) ----------------------------


def _space_bpe(folder: Path, *, specials: list[str], words: bool, normalizer, pre_tokenizer, decoder, bos: str,
               config: dict, generation: dict | None = None, flags: dict | None = None) -> tuple:
    """Trained over words (each "▁" starts one, as SentencePiece trains) or over whole paragraphs
    (tokens may then cross a "▁"); the 256 <0xNN> byte tokens put after the specials, as in the
    published vocabularies; then set up as the family's file is."""
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True) if words \
        else None
    trainer = trainers.BpeTrainer(vocab_size=1100, min_frequency=2, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    data = json.loads(tok.to_str())
    old = data["model"]["vocab"]
    vocab = {t: n for n, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(old.items(), key=lambda item: item[1]):
        vocab.setdefault(t, len(vocab))
    data["model"]["vocab"] = vocab
    for entry in data["added_tokens"]:
        entry["id"] = vocab[entry["content"]]
        entry.update((flags or {}).get(entry["content"], {}))
    tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    return tok, _save(folder, tok, config, generation)


MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
LLAMA_DECODER = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])


def mistral(folder: Path):
    """Mistral v0.3 (Llama-2's legacy kind): "▁" before every stretch between added tokens."""
    return _space_bpe(folder, specials=MISTRAL_SPECIALS, words=True,
                      normalizer=normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]),
                      pre_tokenizer=None, decoder=LLAMA_DECODER, bos="<s>",
                      config={"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                              "unk_token": "<unk>", "add_bos_token": True, "chat_template": MISTRAL_V3_TEMPLATE})


def mistral_metaspace(folder: Path):
    """The newer form of the same: Metaspace pre-tokenizer, "▁" before the text's first stretch only."""
    return _space_bpe(folder, specials=MISTRAL_SPECIALS, words=True, normalizer=None,
                      pre_tokenizer=pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False),
                      decoder=LLAMA_DECODER, bos="<s>",
                      config={"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                              "unk_token": "<unk>", "chat_template": MISTRAL_V3_TEMPLATE})


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_DECODER = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])


def gemma(folder: Path, template: str | None = None):
    """Gemma: no "▁" prepended; trained over whole paragraphs, so tokens may cross a "▁"; a run of
    four spaces as an added token, normalized and not special (a user-defined piece)."""
    tok, folder = _space_bpe(folder, specials=GEMMA_SPECIALS, words=False, normalizer=normalizers.Replace(" ", SPACE),
                             pre_tokenizer=pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False),
                             decoder=GEMMA_DECODER, bos="<bos>",
                             config={"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                                     "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
                                     "chat_template": template or GEMMA3_TEMPLATE},
                             generation={"bos_token_id": 2, "eos_token_id": [1, 6]})
    tok.add_tokens([AddedToken(SPACE * 4, normalized=True, special=False)])
    return tok, _save(folder, tok, json.loads((folder / "tokenizer_config.json").read_text()))


PHI3_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"]


def phi3(folder: Path):
    """Phi-3: Llama-2's kind, its chat tokens added with rstrip (they take the whitespace after them)."""
    flags = {t: {"rstrip": True} for t in ("<|assistant|>", "<|end|>", "<|system|>", "<|user|>")}
    return _space_bpe(folder, specials=PHI3_SPECIALS, words=True,
                      normalizer=normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]),
                      pre_tokenizer=None, decoder=LLAMA_DECODER, bos="<s>", flags=flags,
                      config={"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "<|endoftext|>",
                              "unk_token": "<unk>", "pad_token": "<|endoftext|>", "chat_template": PHI3_TEMPLATE})


# --- the published chat templates (tokenizer_config.json's chat_template) ---------------------

# Qwen2.5-Instruct: ChatML, a default system prompt when the conversation has none, tools.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Gemma 1 and 2 (-it): no system role (raises), roles alternate, "model" for the assistant.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

# Gemma 3 (-it): a system message is folded into the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")

# Mistral-7B-Instruct-v0.3 (tokenizer v3): [INST] ... [/INST], the system message in front of the
# LAST user turn, tools; the assistant's content trimmed, after a space, then </s>.
MISTRAL_V3_TEMPLATE = (
    "{%- if messages[0][\"role\"] == \"system\" %}\n    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{%- set user_messages = loop_messages | selectattr(\"role\", \"equalto\", \"user\") | list %}\n\n"
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n{%- set ns.index = 0 %}\n{%- for message in loop_messages %}\n"
    "    {%- if not (message.role == \"tool\" or message.role == \"tool_results\" or (message.tool_calls is defined "
    "and message.tool_calls is not none)) %}\n        {%- if (message[\"role\"] == \"user\") != (ns.index % 2 == 0) %}\n"
    "            {{- raise_exception(\"After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n        {%- endif %}\n        {%- set ns.index = ns.index + 1 %}\n"
    "    {%- endif %}\n{%- endfor %}\n\n{{- bos_token }}\n{%- for message in loop_messages %}\n"
    "    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    "            {{- \"[AVAILABLE_TOOLS] [\" }}\n            {%- for tool in tools %}\n"
    "                {%- set tool = tool.function %}\n"
    "                {{- '{\"type\": \"function\", \"function\": {' }}\n"
    "                {%- for key, val in tool.items() if key != \"return\" %}\n"
    "                    {%- if val is string %}\n                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n                    {%- if not loop.last %}\n"
    "                        {{- \", \" }}\n                    {%- endif %}\n                {%- endfor %}\n"
    "                {{- \"}}\" }}\n                {%- if not loop.last %}\n                    {{- \", \" }}\n"
    "                {%- else %}\n                    {{- \"]\" }}\n                {%- endif %}\n"
    "            {%- endfor %}\n            {{- \"[/AVAILABLE_TOOLS]\" }}\n            {%- endif %}\n"
    "        {%- if (message == user_messages[-1]) and system_message is defined %}\n"
    "            {{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}\n"
    "        {%- else %}\n            {{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}\n        {%- endif %}\n"
    "    {%- elif message.tool_calls is defined and message.tool_calls is not none %}\n"
    "        {{- \"[TOOL_CALLS] [\" }}\n        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    "                {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "            {%- endif %}\n            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n                {{- \", \" }}\n            {%- else %}\n"
    "                {{- \"]\" + eos_token }}\n            {%- endif %}\n        {%- endfor %}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n        {{- \" \" + message[\"content\"]|trim + eos_token}}\n"
    "    {%- elif message[\"role\"] == \"tool_results\" or message[\"role\"] == \"tool\" %}\n"
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n        {%- else %}\n"
    "            {%- set content = message.content %}\n        {%- endif %}\n"
    "        {{- '[TOOL_RESULTS] {\"content\": ' + content|string + \", \" }}\n"
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    "            {{- raise_exception(\"Tool call IDs should be alphanumeric strings with length 9!\") }}\n"
    "        {%- endif %}\n        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n        {{- raise_exception(\"Only user and assistant roles are supported, with the exception "
    "of an initial optional system message!\") }}\n    {%- endif %}\n{%- endfor %}\n")

# Phi-3-mini-4k-instruct: <|role|> lines ending in <|end|>; EOS at the end unless a generation prompt.
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


# --- the families, built once per module ----------------------------------------------------

BUILDERS = {"qwen2": qwen2, "olmo2": olmo2, "granite": granite, "neox": neox, "mistral": mistral,
            "mistral_metaspace": mistral_metaspace, "gemma": gemma, "phi3": phi3}
KINDS = {"qwen2": "byte-level-bpe", "olmo2": "byte-level-bpe", "granite": "byte-level-bpe", "neox": "byte-level-bpe",
         "mistral": "sentencepiece-bpe", "mistral_metaspace": "sentencepiece-bpe", "gemma": "sentencepiece-bpe",
         "phi3": "sentencepiece-bpe"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = BUILDERS[name](tmp_path_factory.mktemp(name))
        return built[name]
    return get


def texts(tok) -> list[str]:
    """The sample, with the tokenizer's added tokens inside it, at its start and end, next to
    spaces (what lstrip/rstrip take) and each other; rare characters; edge cases."""
    added = sorted(tok.get_added_tokens_decoder().values(), key=lambda t: t.content)
    inner = " ".join(f"a{t.content}b  {t.content} \n{t.content}{t.content}" for t in added)
    first = added[0].content if added else ""
    return [SAMPLE, SAMPLE + RARE, inner, first + SAMPLE + first, " leading space", "  two leading", "x", "",
            "\n\n\n", "    four    spaces     five", "1234567890 ½ ٣ 12.5%", RARE, SPACE + "already" + SPACE * 2]


@pytest.mark.parametrize("name", BUILDERS)
def test_ids_equal_the_tokenizers_library(family, name):
    ref, folder = family(name)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.kind == KINDS[name]
    for text in texts(ref):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
        # With BOS where zoo adds one (the template post-processor's; none for the byte-level families).
        assert tok.encode(text, add_bos=tok.adds_bos) == ref.encode(text).ids, text


@pytest.mark.parametrize("name", BUILDERS)
def test_decode_round_trip(family, name):
    ref, folder = family(name)
    tok = Tokenizer.from_pretrained(folder)
    nfc = isinstance(ref.normalizer, normalizers.NFC)  # NFC composes "e\u0301" into "é": decoded composed
    for text in (SAMPLE, SAMPLE + RARE, "x", "\n\n\n", "    four    spaces     five"):
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        if name == "mistral_metaspace" and text.startswith(" "):
            # Metaspace puts no "▁" before text that starts with a space, and decoding takes one off
            # the start either way: a leading space is lost, as with the library.
            text = text[1:]
        assert tok.decode(ids) == (unicodedata.normalize("NFC", text) if nfc else text), text
    # Special tokens are written back as their text, and skipped on request.
    special = next(t.content for t in ref.get_added_tokens_decoder().values() if t.special)
    mixed = "one" + special + "two"
    assert tok.decode(tok.encode(mixed), skip_special=True) == "onetwo"
    assert special in tok.decode(tok.encode(mixed))


def test_bos_eos_of_each_family(family):
    expected = {  # bos, eos ids as the family's files name them
        "qwen2": (None, "<|im_end|>"), "neox": ("<|endoftext|>", "<|endoftext|>"),
        "granite": ("<|end_of_text|>", "<|end_of_text|>"), "mistral": ("<s>", "</s>"),
        "gemma": ("<bos>", "<eos>"), "phi3": ("<s>", "<|endoftext|>")}
    for name, (bos, eos) in expected.items():
        ref, folder = family(name)
        tok = Tokenizer.from_pretrained(folder)
        assert tok.bos_id == (ref.token_to_id(bos) if bos else None), name
        assert tok.eos_id == ref.token_to_id(eos), name
    # Gemma's generation_config.json adds <end_of_turn> to the ids that end generation.
    ref, folder = family("gemma")
    assert Tokenizer.from_pretrained(folder).eos_ids == (ref.token_to_id("<eos>"), ref.token_to_id("<end_of_turn>"))


def test_tokens_across_a_space_mark_keep_one_piece(family):
    """Gemma's vocabulary here was trained over paragraphs: some tokens hold a character then
    "▁", so zoo cannot cut the text at the "▁" runs and encodes each stretch as one piece; the
    Mistral one was trained over words and is cut. Both give the library's ids (above)."""
    gemma_ref, gemma_folder = family("gemma")
    _, mistral_folder = family("mistral")
    crossing = [t for t in gemma_ref.get_vocab() if len(t) > 1 and SPACE in t.lstrip(SPACE)]
    assert crossing, "the paragraph-trained vocabulary has tokens across a space mark"
    assert Tokenizer.from_pretrained(gemma_folder)._backend.encoding._pat_str == r"[\s\S]+"
    assert Tokenizer.from_pretrained(mistral_folder)._backend.encoding._pat_str != r"[\s\S]+"


# --- refused: what zoo cannot encode exactly ---------------------------------------------------


def _edited(family, name: str, tmp_path: Path, edit) -> Path:
    _, folder = family(name)
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    out = tmp_path / name
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("name, edit, key, message", [
    ("gemma", lambda d: d["model"].update(byte_fallback=False), "model.byte_fallback", "byte_fallback true"),
    ("gemma", lambda d: d["model"]["vocab"].pop("<0x41>"), "model.vocab", "<0x41> is not in the vocabulary"),
    ("gemma", lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer", "Lowercase"),
    ("gemma", lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]}), "normalizer", "NFKC"),
    ("gemma", lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer", "Whitespace"),
    ("mistral_metaspace", lambda d: d["pre_tokenizer"].update(replacement="_"), "pre_tokenizer", "neither"),
    ("mistral", lambda d: d.update(normalizer={"type": "Prepend", "prepend": SPACE}), "normalizer", "without Replace"),
    ("mistral", lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer", "Whitespace"),
    ("mistral", lambda d: d["added_tokens"][3].update(single_word=True), "added_tokens[3].single_word",
     "single word"),
    ("qwen2", lambda d: d.update(normalizer={"type": "NFKC"}), "normalizer", "NFKC"),
    ("qwen2", lambda d: d["model"].update(byte_fallback=True), "model.byte_fallback", "byte-level"),
    ("qwen2", lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed"), "pre_tokenizer",
     "Isolated"),
    ("neox", lambda d: d["model"].update(dropout=0.1), "model.dropout", "not supported"),
])
def test_what_zoo_cannot_encode_is_refused(family, tmp_path, name, edit, key, message):
    folder = _edited(family, name, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: " + repr(key).replace("[", r"\[").replace("]", r"\]")
                       + ".*" + message.replace("(", r"\(")) as caught:
        Tokenizer.from_pretrained(folder)
    assert caught.value.key == key


def test_a_folder_with_tokenizer_model_keeps_reading_it(family, tmp_path):
    """A SentencePiece-style tokenizer.json is read where there is no tokenizer.model; where there
    is one (Llama-2, Mistral, Gemma, Phi-3 ship both), sentencepiece reads that, as before."""
    from helpers import LLAMA2_TOKENIZER
    if not LLAMA2_TOKENIZER.exists():
        pytest.skip(f"{LLAMA2_TOKENIZER} is not here")
    _, folder = family("mistral")
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (both / "tokenizer.model").write_bytes(LLAMA2_TOKENIZER.read_bytes())
    assert Tokenizer.from_pretrained(both).kind == "sentencepiece"
    assert Tokenizer.from_pretrained(both / "tokenizer.json").kind == "sentencepiece-bpe"


def test_saved_folder_reads_back_the_same(family, tmp_path):
    for name in ("gemma", "mistral_metaspace", "neox"):
        _, folder = family(name)
        tok = Tokenizer.from_pretrained(folder)
        tok.save(tmp_path / name)
        if (folder / "generation_config.json").exists():  # the model's file (Gemma's end-of-turn stop id)
            (tmp_path / name / "generation_config.json").write_bytes((folder / "generation_config.json").read_bytes())
        again = Tokenizer.from_pretrained(tmp_path / name)
        assert again.encode(SAMPLE + RARE) == tok.encode(SAMPLE + RARE), name
        assert again.fingerprint() == tok.fingerprint(), name


# --- chat templates: as transformers renders them, the loss mask on the assistant's turns ------

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "Answer briefly. Réponds en français si on te parle français."}
CHAT = [
    {"role": "user", "content": "  What is the capital of France?\n"},
    {"role": "assistant", "content": "Paris — ville lumière. "},
    {"role": "user", "content": "И столица Японии? 日本の首都は？ 🙂"},
    {"role": "assistant", "content": "東京 (Tokyo).\n\n  def f(): return {'a': 1}"},
]
# name -> (builder, how the template ends an assistant turn, whether it takes a system message)
TEMPLATES = {
    "qwen2.5": ("qwen2", lambda c: c + "<|im_end|>\n", True),
    "gemma3": ("gemma", lambda c: c.strip() + "<end_of_turn>\n", True),
    "mistral-v3": ("mistral", lambda c: " " + c.strip() + "</s>", True),
    # Phi-3: its EOS after the last turn; <|end|> takes the newline after it (rstrip).
    "phi3": ("phi3", lambda c: c + "<|end|><|endoftext|>", True),
}


def _reference(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", TEMPLATES)
def test_published_template_renders_as_transformers(family, name):
    builder, _, _ = TEMPLATES[name]
    _, folder = family(builder)
    template = ChatTemplate.for_folder(folder)
    reference = _reference(folder)
    for messages in ([SYSTEM] + CHAT, CHAT, CHAT[:1], [SYSTEM] + CHAT[:3]):
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == expected, (messages, prompt)


def test_qwen_default_system_prompt(family):
    _, folder = family("qwen2")
    template = ChatTemplate.for_folder(folder)
    assert template.render(CHAT[:1]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n")
    assert template.render([SYSTEM] + CHAT[:1]).startswith(f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n")


def test_gemma_system_message(family, tmp_path):
    """Gemma 1/2's template refuses a system message, as in transformers; Gemma 3's folds it
    into the first user turn."""
    _, folder = family("gemma")
    old = tmp_path / "gemma1"
    old.mkdir()
    (old / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GEMMA_TEMPLATE}))
    reference = _reference(old)
    template = ChatTemplate.for_folder(old)
    for prompt in (False, True):
        assert template.render(CHAT, add_generation_prompt=prompt) == reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=prompt)
    with pytest.raises(Exception, match="System role not supported"):
        reference.apply_chat_template([SYSTEM] + CHAT, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json chat_template: .*System role not supported"):
        template.segments([SYSTEM] + CHAT)
    folded = ChatTemplate.for_folder(folder).render([SYSTEM] + CHAT[:1])
    assert folded == f"<bos><start_of_turn>user\n{SYSTEM['content']}\n\n{CHAT[0]['content'].strip()}<end_of_turn>\n"


def _chat_ids(folder: Path, messages: list[dict]):
    from zoo.train.data import _Encoder
    tok = Tokenizer.from_pretrained(folder)
    return tok, _Encoder(tok, ChatTemplate.for_folder(folder)).chat(messages, "test")


@pytest.mark.parametrize("name", TEMPLATES)
def test_loss_mask_covers_the_assistant_turns(family, name):
    builder, piece, _ = TEMPLATES[name]
    # Mistral v3 without a system message, Phi-3 with one assistant turn (see the refusals below).
    messages = {"mistral-v3": CHAT, "phi3": [SYSTEM] + CHAT[:2]}.get(name, [SYSTEM] + CHAT)
    ref, folder = family(builder)
    tok, (ids, trained) = _chat_ids(folder, messages)
    # The ids are the library's for transformers' rendering. (Not transformers' own ids for the
    # Llama-2 kind: transformers 5's LlamaTokenizer swaps the file's Prepend normalizer for a
    # Metaspace pre-tokenizer, which encodes " What" after [INST] differently from tokenizer.json.)
    rendered = _reference(folder).apply_chat_template(messages, tokenize=False)
    assert ids == ref.encode(rendered, add_special_tokens=False).ids
    # Trained: exactly each assistant turn with the end of turn the template writes.
    runs, run = [], []
    for i, mine in zip(ids, trained):
        if mine:
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    expected = [piece(m["content"]) for m in messages if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == expected


def test_templates_zoo_cannot_mask_are_refused(family):
    """Mistral v3 puts the system message in front of the LAST user turn, and Phi-3 writes EOS
    after the conversation unless a generation prompt follows: the conversation up to an earlier
    assistant turn does not start the whole one, so that turn's tokens cannot be told apart."""
    _, mistral_folder = family("mistral")
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 2"):
        ChatTemplate.for_folder(mistral_folder).segments([SYSTEM] + CHAT)
    _, phi3_folder = family("phi3")
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 1"):
        ChatTemplate.for_folder(phi3_folder).segments(CHAT)
    # One assistant turn is fine: Phi-3's EOS after it is the assistant's.
    pieces = ChatTemplate.for_folder(phi3_folder).segments(CHAT[:2])
    assert [t for t, mine in pieces if mine] == [CHAT[1]["content"] + "<|end|>\n<|endoftext|>"]


@pytest.mark.parametrize("name", BUILDERS)
def test_random_texts_equal_the_tokenizers_library(family, name):
    """Short random texts over what is hard: spaces and "▁" runs, newlines, tabs, digits,
    composed and decomposed accents, rare characters, added tokens next to all of them."""
    import random
    ref, folder = family(name)
    tok = Tokenizer.from_pretrained(folder)
    added = [t.content for t in ref.get_added_tokens_decoder().values()]
    pieces = [" ", "  ", "   ", SPACE, "\n", "\t", "\r\n", "a", "the", "The", "'s", "12", "7", "é", "e\u0301", "日本",
              "ж", "🙂", "ꙮ", "𝔘", "-", ".", "(", "x"] + added
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, repr(text)
