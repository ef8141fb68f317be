"""The tokenizer follows the model: the protocol's two implementations, chat templates token for token
as transformers renders them, stop sets in the sampler, and tiny local checkpoints with their own BPE
vocabulary trained end to end through `loop.run` (GRPO and OPD)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import ml_collections
import pytest

from jaxrl_llm import loop
from jaxrl_llm.config import ConfigError, load_file
from jaxrl_llm.models import ModelConfig, init_params
from jaxrl_llm.sampling import SamplerConfig, generate
from jaxrl_llm.sampling import partial as partial_lib
from jaxrl_llm.policy_init import tokenizer_for_checkpoint
from jaxrl_llm.tasks.encoder import CHAR_ENCODER, Encoder, fit_examples, round_width
from jaxrl_llm.tasks.tokenizer import CHAR_TOKENIZER, Tokenizer, completion_text

import tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A tiny Llama with a ChatML-templated BPE tokenizer and generation_config eos ids [0, 2]."""
  return tiny_hf.make_checkpoint(tmp_path_factory.mktemp("student"), seed=0, generation_eos=[0, 2])


@pytest.fixture(scope="module")
def hf_tok(ckpt):
  return tokenizer_for_checkpoint(ckpt)


# ----------------------------------------------------------------------------- the protocol


def test_char_tokenizer_behind_the_protocol(tmp_path):
  t = CHAR_TOKENIZER
  assert isinstance(t, Tokenizer)
  assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id, t.stop_ids) == (64, 1, 2, 0, (2,))
  assert t.encode("12") == [5, 6] and t.encode("12", add_special_tokens=True) == [1, 5, 6]
  assert t.decode([1, 5, 6, 0]) == "12"
  assert completion_text(t, np.array([5, 6, 2, 7, 0])) == "12" and completion_text(t, []) == ""
  assert CHAR_ENCODER.prompt_ids("12+3=") == [1, 5, 6, 14, 7, 17]  # BOS + one id per character
  assert CHAR_ENCODER.target_ids("59") == [9, 13, 2]  # answer + EOS
  with pytest.raises(ValueError, match="no chat template"):
    Encoder(t, "chat")
  t.save(tmp_path)  # an export of a char model loads back with the char tokenizer
  assert tokenizer_for_checkpoint(tmp_path) is CHAR_TOKENIZER


def test_checkpoint_tokenizer_ids_and_stop_set(hf_tok):
  t = hf_tok
  assert isinstance(t, Tokenizer)
  # SPECIALS = <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2; EOS is <|endoftext|>, no pad -> pad = EOS.
  assert (t.vocab_size, t.bos_id, t.eos_id, t.pad_id) == (300, None, 0, 0)
  assert t.end_of_turn_id == 2  # what the template writes after an assistant message
  assert t.stop_ids == (0, 2)
  ids = t.encode("12+47=")
  assert max(ids) < 300 and t.decode(ids) == "12+47="
  assert t.decode([1] + ids + [2, 0]) == "12+47="  # special tokens dropped
  answer = t.encode("59")
  assert completion_text(t, np.array(answer + [2] + answer + [0])) == "59"  # cut at the end-of-turn id
  assert completion_text(t, np.array(answer + [0, 7, 7])) == "59"  # ... or at EOS
  assert Encoder(t, "chat").target_ids("59") == answer + [2]
  assert Encoder(t, "none").target_ids("59") == answer + [0]


def test_generation_config_stop_ids_and_pad_token(tmp_path):
  tiny_hf.make_tokenizer(tmp_path, template=None, generation_eos=[1])
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "pad_token": "<|im_end|>"}))
  t = tokenizer_for_checkpoint(tmp_path)
  assert (t.pad_id, t.stop_ids, t.end_of_turn_id, t.chat_template) == (2, (0, 1), None, None)


# ----------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("template_file", [False, True])
@pytest.mark.parametrize("system", ["", "You are a calculator."])
def test_chat_prompt_equals_transformers_apply_chat_template(tmp_path, template_file, system):
  import tokenizers
  folder = tiny_hf.make_tokenizer(tmp_path, template_file=template_file)
  enc = Encoder(tokenizer_for_checkpoint(folder), "auto", system)
  assert enc.chat
  messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "12+47="}]
  ref = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
      messages, add_generation_prompt=True, tokenize=True)["input_ids"]
  assert enc.prompt_ids("12+47=") == list(ref)
  # Independently: the ChatML text written out by hand, tokenized by the bare `tokenizers` library.
  text = (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + \
      "<|im_start|>user\n12+47=<|im_end|>\n<|im_start|>assistant\n"
  bare = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
  assert enc.prompt_ids("12+47=") == bare.encode(text, add_special_tokens=False).ids
  assert enc.prompt_ids("12+47=")[:1] == [1] and enc.prompt_ids("12+47=")[-1] != 2


def test_template_modes_and_errors(tmp_path):
  base = tokenizer_for_checkpoint(tiny_hf.make_tokenizer(tmp_path / "base", template=None))
  assert not Encoder(base, "auto").chat  # a base model: raw text
  assert Encoder(base, "none").prompt_ids("12+47=") == base.encode("12+47=", add_special_tokens=True)
  with pytest.raises(ValueError, match="has no chat template"):
    Encoder(base, "chat")
  with pytest.raises(ValueError, match="system_prompt"):
    Encoder(base, "auto", "be brief")
  with pytest.raises(ValueError, match="chat_template='jinja'"):
    Encoder(base, "jinja")
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
    os.makedirs(tmp_path / "empty")
    tokenizer_for_checkpoint(tmp_path / "empty")


def test_prompt_buckets_and_dropping(hf_tok):
  enc = Encoder(hf_tok, "chat")
  examples = [{"prompt": p} for p in ("1+1=", "12+47=", "12+47=" * 20)]
  lens = [len(enc.prompt_ids(ex["prompt"])) for ex in examples]
  assert lens[0] < lens[1] < 48 < lens[2]
  kept, dropped = fit_examples(enc, examples, 48)
  assert kept == examples[:2] and dropped == 1
  assert [round_width(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]


def test_grain_pipeline_encodes_through_the_encoder(hf_tok):
  from jaxrl_llm.tasks.pipeline import make_prompt_dataset
  enc = Encoder(hf_tok, "chat")
  batch = make_prompt_dataset("arithmetic", "train", 4, 0, source="memory", num_train=20, num_test=5,
                              encoder=enc, shuffle=False)[0]
  P, A = batch["prompt_tokens"].shape[1], batch["answer_tokens"].shape[1]
  assert P % 16 == 0 and A % 16 == 0
  for b in range(4):
    prompt, answer = batch["prompt"][b].decode(), batch["answer"][b].decode()
    ids = enc.prompt_ids(prompt)
    assert batch["prompt_len"][b] == len(ids) and batch["prompt_tokens"][b, P - len(ids):].tolist() == ids
    assert (batch["prompt_tokens"][b, :P - len(ids)] == hf_tok.pad_id).all()
    n = batch["answer_len"][b]
    assert batch["answer_tokens"][b, n - 1] == 2 and hf_tok.decode(batch["answer_tokens"][b, :n]) == answer


# ----------------------------------------------------------------------------- sampler: several stop ids


SCFG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=32)
PARAMS = init_params(SCFG, jax.random.key(3))
PROMPTS = jnp.array([[0, 0, 5, 6], [0, 7, 8, 9], [4, 3, 2, 1]], jnp.int32)
PLEN = jnp.array([2, 3, 4], jnp.int32)
N = 10


def test_sampler_stops_on_any_of_several_stop_ids_and_exits_early():
  greedy = SamplerConfig(max_new_tokens=N, stop_ids=(), temperature=0.0, pad_id=31)
  ref = np.asarray(generate(PARAMS, PROMPTS, PLEN, jax.random.key(0), SCFG, greedy)["tokens_BN"])
  stops = (int(ref[0, 2]), int(ref[1, 1]))
  sc = dataclasses.replace(greedy, stop_ids=stops)
  assert sc.stop_ids == tuple(sorted(set(stops)))
  out = jax.tree.map(np.asarray, generate(PARAMS, PROMPTS, PLEN, jax.random.key(0), SCFG, sc))
  ends = []
  for b in range(3):  # greedy: the stopped row is the unstopped row's prefix up to its first stop id
    hits = np.flatnonzero(np.isin(ref[b], stops))
    end = int(hits[0]) + 1 if hits.size else N
    ends.append(end)
    np.testing.assert_array_equal(out["tokens_BN"][b, :end], ref[b, :end])
    assert (out["tokens_BN"][b, end:] == 31).all()
    assert out["mask_BN"][b].tolist() == [1.0] * end + [0.0] * (N - end)
    assert out["finished_B"][b] == bool(hits.size)
  assert ends[0] <= 3 and ends[1] <= 2
  # Early exit: once every row has stopped, decoding stops (the partial sampler's carry shows the step).
  all_stop = tuple(sorted({int(ref[b, 0]) for b in range(3)}))
  sc_all = dataclasses.replace(greedy, stop_ids=all_stop)
  carry = partial_lib.prefill(PARAMS, PROMPTS, PLEN, jax.random.key(0), 0, SCFG, sc_all)
  carry = partial_lib.decode_until(PARAMS, carry, jax.random.key(0), N, 0, SCFG, sc_all)
  assert int(carry["step"]) == 1 and bool(jnp.all(carry["done_B"]))


def test_prompts_of_different_lengths_share_one_compiled_bucket():
  sc = SamplerConfig(max_new_tokens=3, stop_ids=(4, 9), temperature=0.9, pad_id=0)  # a config no other test uses
  generate(PARAMS, PROMPTS, PLEN, jax.random.key(1), SCFG, sc)
  n = generate._cache_size()
  generate(PARAMS, PROMPTS, jnp.array([1, 4, 2], jnp.int32), jax.random.key(2), SCFG, sc)
  assert generate._cache_size() == n


def test_sampler_config_stop_ids_are_canonical():
  assert SamplerConfig(max_new_tokens=2, stop_ids=[3, 1, 3]).stop_ids == (1, 3)
  with pytest.raises(ValueError, match="stop_ids"):
    SamplerConfig(max_new_tokens=2, stop_ids=("x",))


# ----------------------------------------------------------------------------- end to end


def tiny(init_from, **over):
  c = load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  c.checkpoint.every = 0
  c.model.init_from = str(init_from)
  c.num_steps = 2
  c.rollout.prompts_per_step, c.rollout.group_size = 2, 2
  c.sft.steps, c.sft.batch_size = 2, 4
  c.eval.every, c.eval.num_prompts = 2, 4
  for k, v in over.items():
    sec, key = k.split("__")
    c[sec][key] = v
  return c


def test_grpo_from_a_checkpoint_with_its_own_tokenizer(ckpt, hf_tok, tmp_path):
  c = tiny(ckpt, sft__save_to=str(tmp_path / "export"))
  r = loop.setup(c)
  assert r.model_cfg.vocab_size == 320 and r.model_cfg.n_layers == 1
  assert r.samp_cfg.stop_ids == (0, 2) and r.samp_cfg.pad_id == 0
  longest = max(len(r.encoder.prompt_ids(ex["prompt"])) for ex in r.train_examples)
  assert r.P == round_width(longest) and r.prompts_dropped == 0
  assert r.test.tokens_BP[0, -1] == hf_tok.encode("assistant\n")[-1]  # the generation prompt ends every row
  rows = loop.run(c, str(tmp_path / "run"))
  assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
  assert all(0 < row["completion_len"] <= c.sampler.max_new_tokens for row in rows)
  info = json.load(open(tmp_path / "run" / "run_info.json"))
  assert info["prompts_dropped"] == 0 and np.isfinite(info["sft_final_loss"])
  exported = tokenizer_for_checkpoint(tmp_path / "export")  # the export carries its tokenizer
  assert exported.hf.get_vocab() == hf_tok.hf.get_vocab() and exported.stop_ids == hf_tok.stop_ids


def test_opd_with_a_teacher_sharing_the_tokenizer(ckpt, tmp_path):
  teacher = tiny_hf.make_checkpoint(tmp_path / "teacher", seed=1, n_layers=2, generation_eos=[0, 2])
  c = tiny(ckpt)
  opd = load_file(os.path.join(ROOT, "configs", "opd_default.py"))
  c.loss, c.distill = opd.loss, opd.distill
  c.distill.teacher = str(teacher)
  c.distill.topk = 4
  c.sft.steps = 0
  rows = loop.run(c, str(tmp_path / "run"))
  assert len(rows) == 2 and all(np.isfinite(row["loss"]) for row in rows)
  other = tiny_hf.make_checkpoint(tmp_path / "other", seed=1, vocab_size=290)  # same 320 rows, other tokens
  c.distill.teacher = str(other)
  with pytest.raises(ConfigError, match="config.distill.teacher=.*not the student's"):
    loop.setup(c)


def test_checkpoint_bad_input_names_the_field(ckpt, tmp_path):
  from jaxrl_llm.models import save_hf
  cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)
  save_hf(str(tmp_path / "bare"), cfg, init_params(cfg, jax.random.key(0)))
  with pytest.raises(ConfigError, match=f"config.model.init_from=.*{tmp_path / 'bare'}.*no tokenizer files"):
    loop.setup(tiny(tmp_path / "bare"))
  with pytest.raises(ConfigError, match="config.sampler.max_new_tokens=128: reaches past the model's context of 128"):
    loop.setup(tiny(ckpt, sampler__max_new_tokens=128))
  with pytest.raises(ConfigError, match="config.task.prompt_width=100: prompt width 100"):
    loop.setup(tiny(ckpt, task__prompt_width=100, sampler__max_new_tokens=40))
  base = tiny_hf.make_checkpoint(tmp_path / "base", template=None)
  with pytest.raises(ConfigError, match="config.task.chat_template='chat': .*has no chat template"):
    loop.setup(tiny(base, task__chat_template="chat"))
  with pytest.raises(ConfigError, match="config.task.system_prompt='hi'"):
    loop.setup(tiny(base, task__system_prompt="hi"))
  with pytest.raises(ConfigError, match="config.task.prompt_width=4: every train prompt is longer"):
    loop.setup(tiny(ckpt, task__prompt_width=4))  # ChatML prompts are longer than 4 tokens
  agent = tiny(ckpt)
  agent.env = ml_collections.ConfigDict(dict(name="guess_number", kwargs={}, max_turns=2, turn_tokens=4,
                                             max_episode_tokens=120, timeout_s=5.0, prompt_width=16))
  with pytest.raises(ConfigError, match="config.env.max_episode_tokens=120: env.prompt_width 16 .* context of 128"):
    loop.setup(agent)
  agent.env.max_episode_tokens = 64
  agent.env.kwargs = ml_collections.ConfigDict({"max_turns": 0})
  with pytest.raises(ConfigError, match=r"config.env.kwargs=\{'max_turns': 0\}: environment 'guess_number' refuses"):
    loop.setup(agent)
  raising = tiny_hf.make_checkpoint(tmp_path / "raising", template="{% if tools %}{{ raise_exception('no tools') }}"
                                    "{% endif %}" + tiny_hf.CHATML)
  tools = tiny(raising)
  tools.env = ml_collections.ConfigDict(dict(agent.env.to_dict(), name="gsm8k_calculator", kwargs={}))
  with pytest.raises(ConfigError, match="config.env.name='gsm8k_calculator': its tool schemas cannot be rendered"):
    loop.setup(tools)
  unclosed = tiny_hf.make_checkpoint(tmp_path / "unclosed", template="{% for m in messages %}{{ m['content'] + '\\n' }}"
                                     "{% endfor %}")
  closed_never = tiny(unclosed)
  closed_never.env = ml_collections.ConfigDict(dict(agent.env.to_dict(), kwargs={}))
  with pytest.raises(ConfigError, match="config.task.chat_template='auto': observations of env.name='guess_number'"):
    loop.setup(closed_never)
