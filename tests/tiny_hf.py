"""Tiny Hugging Face checkpoints made locally for the tests: a byte-level BPE tokenizer with its own
vocabulary (~300 ids, ChatML-like chat template) and a random tiny Llama saved with `save_hf`."""

import json
import pathlib

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2


def corpus() -> list[str]:
  """Training text: arithmetic prompts and answers plus the words of the chat turns."""
  lines = [f"{a}+{b}={a + b}\n" for a in range(10, 100, 3) for b in range(10, 100, 7)]
  return lines + ["system\nuser\nassistant\nYou are a calculator. Answer with the number only.\n"] * 20


def make_tokenizer(path, *, template: str | None = CHATML, template_file: bool = False, vocab_size: int = 300,
                   generation_eos: list[int] | None = None) -> pathlib.Path:
  """Writes tokenizer.json + tokenizer_config.json (EOS `<|endoftext|>`, no BOS, no pad) into `path`.

  `template`: the chat template, in tokenizer_config.json or (`template_file`) chat_template.jinja;
  None = no template (a base model). `generation_eos`: eos_token_id of a generation_config.json.
  """
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus(), trainer)
  tok.save(str(path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
            "pad_token": None, "model_max_length": 512}
  if template is not None and template_file:
    (path / "chat_template.jinja").write_text(template)
  elif template is not None:
    config["chat_template"] = template
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  if generation_eos is not None:
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
  return path


def make_checkpoint(path, *, seed: int = 0, n_layers: int = 1, d_model: int = 32, max_seq_len: int = 128,
                    **tokenizer_kw) -> pathlib.Path:
  """A tiny random Llama (`save_hf`) with its tokenizer in one folder; the embedding is padded to a
  multiple of 64 rows, as real checkpoints often are."""
  import jax
  from jaxrl_llm.models import ModelConfig, init_params, save_hf
  from jaxrl_llm.models.tokenizer import load_checkpoint_tokenizer
  path = make_tokenizer(path, **tokenizer_kw)
  vocab = -(-load_checkpoint_tokenizer(path).vocab_size // 64) * 64
  cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                    head_dim=d_model // 2, d_ff=2 * d_model, max_seq_len=max_seq_len)
  save_hf(str(path), cfg, init_params(cfg, jax.random.key(seed)), family="llama")
  return path
