"""Plain PyTorch on workload R: `transformers` `generate` with sampling + one hand-written GRPO step.

The floor a torch user gets without an RL framework. Runs ONLY under `bench/.venv-bench` (CPU torch; on a GPU
bench/gpu.sh's `bench/.venv-bench-gpu`, CUDA torch),
as a subprocess of `bench/run.py`, taking turns with our side (`bench/peers/turns.py`). Same workload
as `bench/grpo_real.py`: the HF folder's weights in fp32, prompts from `arithmetic_chat` (same seed, so
the same prompts in the same order) rendered by the tokenizer's chat template, `prompts × G` sampled
completions (temperature 1, no top-k / top-p) of up to N new tokens stopping at EOS, reward = the
task's, GRPO advantages, PPO-clip loss with π_old = the sampling policy (one update per batch: ratio 1),
k3 KL β to a frozen copy, seq-mean-token-mean, AdamW (β₂ 0.98) with global-norm clip 1.0; torch's
threads: 1 or every core, whichever runs small ops faster at start (`turns.pick_torch_threads`); with the
workload's remat "full", `gradient_checkpointing_enable()` (each layer recomputed in the backward pass).
Device: CUDA when `torch.cuda.is_available()` (a CUDA build of torch, as `bench/gpu.sh` installs; each step
ends with `torch.cuda.synchronize()` so the clock sees the GPU's work), else the CPU.

Usage: bench/.venv-bench/bin/python bench/peers/torch_grpo.py --workload R_small --model DIR [--warmup 1 --steps 1 --rounds 2]
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.peers import turns  # noqa: E402


def run(workload: str, model_dir: str, warmup: int, steps: int, rounds: int) -> dict:
  import numpy as np
  import torch
  import transformers
  from bench import workloads
  from jaxrl_llm.tasks import arithmetic

  threads = turns.pick_torch_threads()
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  r = {**workloads.REAL_RUN, **workloads.REAL[workload]}
  G, N = r["group_size"], r["max_new_tokens"]
  torch.manual_seed(r["seed"])
  task = arithmetic.make_chat_task(num_digits=r["num_digits"])
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  tok.padding_side = "left"
  if tok.pad_token is None:
    tok.pad_token = tok.eos_token
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
  if r["remat"] == "full":  # as ours (remat "full") and TRL (gradient_checkpointing on by default)
    model.gradient_checkpointing_enable()
  ref = copy.deepcopy(model).eval()
  for p in ref.parameters():
    p.requires_grad_(False)
  opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], betas=(0.9, 0.98), weight_decay=0.0)
  eos = tok.eos_token_id
  pad = tok.pad_token_id if tok.pad_token_id is not None else eos
  rng = np.random.default_rng(r["seed"])
  clock = turns.StepClock(warmup, steps, rounds)
  lens, rewards_all = [], []

  def logp_of(m, seq, attn, pos, P):
    logits = m(input_ids=seq, attention_mask=attn, position_ids=pos).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seq[:, P:, None])[..., 0]

  for _ in range(clock.total):
    exs = [task.make_example(rng) for _ in range(r["prompts_per_step"])]
    texts = [tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], tokenize=False,
                                     add_generation_prompt=True) for e in exs]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    P = enc["input_ids"].shape[1]
    model.eval()
    with torch.no_grad():
      seq = model.generate(**enc, do_sample=True, temperature=r["temperature"], top_k=0, top_p=1.0,
                           max_new_tokens=N, num_return_sequences=G, eos_token_id=eos, pad_token_id=pad)
    comp = seq[:, P:]
    is_eos = comp == eos
    # The completion: up to and including its first EOS.
    mask = (torch.cumsum(is_eos.int(), 1) - is_eos.int() == 0).float()
    texts_out = tok.batch_decode(comp, skip_special_tokens=True)
    prompt_rows = [e for e in exs for _ in range(G)]
    rewards = [task.reward(e["prompt"], e["answer"], c) for e, c in zip(prompt_rows, texts_out)]
    adv = torch.tensor(turns.group_advantages(rewards, G), device=device)[:, None]
    attn = torch.cat([enc["attention_mask"].repeat_interleave(G, 0), torch.ones_like(comp)], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    model.train()
    with torch.no_grad():
      ref_logp = logp_of(ref, seq, attn, pos, P)
    logp = logp_of(model, seq, attn, pos, P)
    old = logp.detach()  # π_old = the policy that sampled (one update per batch)
    ratio = torch.exp(logp - old)
    eps = r["epsilon"]
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1  # k3
    per_tok = pg + r["beta"] * kl
    loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    lens += mask.sum(1).tolist()
    rewards_all += rewards
    if device.type == "cuda":
      torch.cuda.synchronize()
    clock.end_of_step()
  out = clock.summary()
  return {**out, "rollouts_per_step": r["prompts_per_step"] * G, "completion_len_mean": float(np.mean(lens)),
          "reward_mean": float(np.mean(rewards_all)), "torch_version": torch.__version__,
          "transformers_version": transformers.__version__,
          "gradient_checkpointing": bool(model.is_gradient_checkpointing), "device": str(device),
          **({"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}), **threads}


def main() -> None:
  turns.peer_main(__doc__.splitlines()[0], "torch", ("torch", "transformers"), run)


if __name__ == "__main__":
  main()
