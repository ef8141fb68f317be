"""Tunix's GRPOLearner on the bench GRPO workload; prints one JSON line (the last line of stdout).

Runs ONLY under the bench virtualenv (`bench/.venv-bench`, where `google-tunix` is installed), as a
subprocess of `bench/run.py`. Workload = `bench.workloads.GRPO[<name>]` + `GRPO_RUN`, the same as
`bench/grpo_step.py`: Tunix's Qwen3 model (q/k RMSNorm) built from the config below with random
init (no hub), the project's character tokenizer, 2-digit "ab+cd=" prompts, 8 prompts × 4
generations, 16 new tokens, β = 0.04, colocated (actor, reference and rollout on one mesh),
vanilla rollout engine, one iteration per batch, AdamW + global-norm clip 1.0.

Timing: wall time between the ends of consecutive global steps (each end blocks on the actor's
parameters), median over the steps after `--warmup`.

`--rounds R` (interleaved with our side by `bench/run.py`): after the warm-up and after every block
of `--steps` steps the script prints `{"status": "paused", ...}` and waits for a line on stdin; the
wait is left out of the next step's time. R blocks run in all; the last line summarises every step.

Workload R / R_small (`bench.workloads.REAL`, `--model DIR`): Tunix's Llama-3 family built with the
folder's config (SmolLM2-135M-Instruct: 30 layers, tied embeddings) and its safetensors loaded by
`tunix.models.llama3.params.create_model_from_safe_tensors` (fp32; policy and reference each load it),
the folder's Hugging Face tokenizer (Tunix's `TokenizerAdapter`), the chat-templated `arithmetic_chat`
prompts in the order ours uses (same seed), Tunix's vanilla sampler, prompts × G rollouts of up to N
new tokens stopping at EOS, β = 0.04, one iteration per batch, AdamW (β₂ 0.98) + clip 1.0; with the
workload's remat "full", `RematConfig.DECODER` (each decoder layer recomputed in the backward pass, as ours).

Usage: bench/.venv-bench/bin/python bench/peers/tunix_grpo.py --workload 2L-d128 [--warmup 2 --steps 5 --rounds 1]
       bench/.venv-bench/bin/python bench/peers/tunix_grpo.py --workload R_small --model DIR [...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
from bench.peers.turns import pauses_after, step_times  # noqa: E402,F401 -- the shared protocol


def _emit(result: dict) -> None:
  print(json.dumps(result), flush=True)


def _tokenizer(tok, vocab_size: int):
  """The project's character tokenizer behind the methods Tunix's TokenizerAdapter requires."""

  class CharTokenizer:
    def encode(self, text, **kwargs):
      del kwargs
      return tok.encode(text)  # Tunix's sampler prepends BOS itself

    def decode(self, ids, **kwargs):
      del kwargs
      return tok.decode([i for i in ids if 0 <= int(i) < vocab_size])

    def bos_id(self):
      return tok.bos_id

    def eos_id(self):
      return tok.eos_id

    def pad_id(self):
      return tok.pad_id

  return CharTokenizer()


def _pause(done: int) -> float:
  """Tells the parent that `done` timed steps have run, waits for its go-ahead; returns when it came."""
  _emit({"status": "paused", "steps_done": done})
  if not sys.stdin.readline():
    raise SystemExit("bench parent closed the pipe")
  return time.perf_counter()


def run(workload: str, warmup: int, steps: int, rounds: int = 1) -> dict:
  sys.path.insert(0, _ROOT)
  from bench import workloads
  from jaxrl_llm.tasks import arithmetic
  from jaxrl_llm.tasks import tokenizer as tok

  import jax
  import numpy as np
  import optax
  from flax import nnx
  import tunix
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  m, r = workloads.GRPO[workload], workloads.GRPO_RUN
  task = arithmetic.make_task(num_digits=r["num_digits"])
  P, N = task.max_prompt_len + 1, r["max_new_tokens"]
  cfg = qwen3.ModelConfig(num_layers=m["n_layers"], vocab_size=m["vocab_size"], embed_dim=m["d_model"],
                          hidden_dim=m["d_ff"], num_heads=m["n_heads"], head_dim=m["head_dim"],
                          num_kv_heads=m["n_kv_heads"], rope_theta=10000, norm_eps=1e-6, use_tied_embedding=False)
  # Auto axes: Tunix's models annotate logical shardings for the classic (non-explicit) mode.
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with mesh:
    actor = qwen3.Qwen3(cfg, rngs=nnx.Rngs(r["seed"]))
    reference = qwen3.Qwen3(cfg, rngs=nnx.Rngs(r["seed"]))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(r["lr"], b1=0.9, b2=0.98, weight_decay=0.0))
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=tx, eval_every_n_steps=10 ** 9,
                                                      max_steps=warmup + steps * rounds),
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=N, max_prompt_length=P, kv_cache_size=P + N,
                                                temperature=r["temperature"], top_p=1.0, top_k=None))
  cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference,
                                     tokenizer=_tokenizer(tok, m["vocab_size"]), cluster_config=cluster_config)

  def reward(prompts, completions, answer, **kwargs):
    del kwargs
    return [task.reward(p, a, c) for p, a, c in zip(prompts, answer, completions)]

  algo = grpo_learner.GRPOConfig(num_generations=r["group_size"], num_iterations=1, beta=r["beta"],
                                 epsilon=r["epsilon"])
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward)

  rng = np.random.default_rng(r["seed"])

  def batches():
    while True:
      exs = [task.make_example(rng) for _ in range(r["prompts_per_step"])]
      # numpy arrays, not lists: Tunix repeats each batch G times with a tree map (a list's strings
      # would be leaves), as its grain-batched datasets are.
      yield {"prompts": np.array([e["prompt"] for e in exs]), "answer": np.array([e["answer"] for e in exs])}

  # Record what the rollout really produced, so a workload mismatch shows up in the result.
  rollout_sizes, completion_lens = [], []
  generate = cluster.generate

  def counted_generate(*args, **kwargs):
    out = generate(*args, **kwargs)
    rollout_sizes.append(len(out.tokens))
    completion_lens.extend(len(t) for t in out.tokens)
    return out

  cluster.generate = counted_generate
  ends = []
  inner = learner._run_global_step  # one global step = generate, reward, ref log-probs, one update

  starts = []  # when each next step's clock starts: this step's end, or the end of a pause after it

  def timed_global_step(*args, **kwargs):
    out = inner(*args, **kwargs)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
    ends.append(time.perf_counter())
    timed = len(ends) - warmup
    starts.append(_pause(timed) if pauses_after(timed, steps, rounds) else ends[-1])
    return out

  learner._run_global_step = timed_global_step
  t0 = time.perf_counter()
  learner.train(batches())
  per_step = step_times(starts, ends, warmup)
  if not per_step:
    return {"status": f"error: only {len(ends)} global steps completed", "tunix_version": tunix.__version__}
  expected = r["prompts_per_step"] * r["group_size"]
  if set(rollout_sizes) != {expected}:
    return {"status": f"workload mismatch: rollout batch sizes {sorted(set(rollout_sizes))}, expected {expected}"}
  return {"status": "ok", "total_s": statistics.median(per_step), "best_total_s": min(per_step), "rollouts_per_step": expected,
          "completion_len_mean": float(np.mean(completion_lens)), "steps": len(per_step), "rounds": rounds,
          "warmup": warmup,
          "setup_and_warmup_s": ends[warmup - 1] - t0, "tunix_version": getattr(tunix, "__version__", "?"),
          "jax_version": jax.__version__}


def _real_prompt_width(tok, prompts) -> int:
  """The prompt bucket ours uses (`tasks.encoder.measured_width`): the longest templated prompt of 64
  sample examples, rounded up to a multiple of 16."""
  texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
           for p in prompts]
  longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
  return -(-longest // 16) * 16


def run_real(workload: str, model_dir: str, warmup: int, steps: int, rounds: int) -> dict:
  """Workload R / R_small on the real checkpoint (see the module docstring)."""
  import json as json_lib

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import transformers
  import tunix
  from flax import nnx
  from tunix.models.llama3 import model as llama3
  from tunix.models.llama3 import params as llama3_params
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  from bench import workloads
  from bench.peers import turns
  from jaxrl_llm.tasks import arithmetic

  r = {**workloads.REAL_RUN, **workloads.REAL[workload]}
  G, N, n_prompts = r["group_size"], r["max_new_tokens"], r["prompts_per_step"]
  task = arithmetic.make_chat_task(num_digits=r["num_digits"])
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  P = _real_prompt_width(tok, [task.make_example(np.random.default_rng(s))["prompt"] for s in range(64)])
  hf = json_lib.load(open(os.path.join(model_dir, "config.json")))
  # Tunix 0.1.7's RematConfig.DECODER fails in the train step with flax's TraceContextError ("Cannot mutate
  # Param from a different trace level"), so a workload that recomputes layers runs Tunix without recomputation
  # (the closest workload it runs) unless BENCH_TUNIX_REMAT=decoder asks to try it.
  forced = os.environ.get("BENCH_TUNIX_REMAT", "none")
  remat = (llama3.RematConfig.DECODER if forced == "decoder" and r["remat"] == "full" else llama3.RematConfig.NONE)
  note = ("remat off: Tunix 0.1.7's RematConfig.DECODER fails with flax TraceContextError "
          "(BENCH_TUNIX_REMAT=decoder tries it); ours recomputes layers, so Tunix does 6N instead of our 8N "
          "FLOPs per token" if remat == llama3.RematConfig.NONE and r["remat"] == "full" else "")
  cfg = llama3.ModelConfig(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
                           embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
                           num_heads=hf["num_attention_heads"], head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                           num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
                           norm_eps=hf["rms_norm_eps"], weight_tying=bool(hf.get("tie_word_embeddings")),
                           # As ours (`remat` "full"): recompute each decoder layer in the backward pass.
                           remat_config=remat)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with mesh:
    actor = llama3_params.create_model_from_safe_tensors(model_dir, cfg, mesh, dtype=jnp.float32)
    reference = llama3_params.create_model_from_safe_tensors(model_dir, cfg, mesh, dtype=jnp.float32)
  clock = turns.StepClock(warmup, steps, rounds)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(r["lr"], b1=0.9, b2=0.98, weight_decay=0.0))
  micro = {}
  if r.get("tunix_micro_prompts"):  # one update per batch, trained and scored in micro-batches; one rollout batch
    micro = dict(mini_batch_size=n_prompts, train_micro_batch_size=r["tunix_micro_prompts"],
                 compute_logps_micro_batch_size=r["tunix_micro_prompts"], rollout_micro_batch_size=n_prompts)
    note = "; ".join(x for x in (note, f"trained and scored in micro-batches of {r['tunix_micro_prompts']} "
                                       f"prompts' groups (train_micro_batch_size)") if x)
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=tx, eval_every_n_steps=10 ** 9,
                                                      max_steps=clock.total, **micro),
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=N, max_prompt_length=P, kv_cache_size=P + N,
                                                temperature=r["temperature"], top_p=1.0, top_k=None))
  cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tok, cluster_config=cluster_config)
  rewards_all = []

  def reward(prompts, completions, question, answer, **kwargs):
    del prompts, kwargs
    out = [task.reward(q, a, c) for q, a, c in zip(question, answer, completions)]
    rewards_all.extend(out)
    return out

  algo = grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=r["beta"], epsilon=r["epsilon"])
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward)
  rng = np.random.default_rng(r["seed"])

  def batches():
    while True:
      exs = [task.make_example(rng) for _ in range(n_prompts)]
      texts = [tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for e in exs]
      yield {"prompts": np.array(texts), "question": np.array([e["prompt"] for e in exs]),
             "answer": np.array([e["answer"] for e in exs])}

  rollout_sizes, completion_lens = [], []
  generate = cluster.generate

  def counted_generate(*args, **kwargs):
    out = generate(*args, **kwargs)
    rollout_sizes.append(len(out.tokens))
    completion_lens.extend(len(t) for t in out.tokens)
    return out

  cluster.generate = counted_generate
  inner = learner._run_global_step

  def timed_global_step(*args, **kwargs):
    out = inner(*args, **kwargs)
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
    clock.end_of_step()
    return out

  learner._run_global_step = timed_global_step
  learner.train(batches())
  res = clock.summary()
  if res["status"] != "ok":
    return {**res, "tunix_version": getattr(tunix, "__version__", "?")}
  if set(rollout_sizes) != {n_prompts * G}:
    return {"status": f"workload mismatch: rollout batch sizes {sorted(set(rollout_sizes))}, expected {n_prompts * G}"}
  return {**res, "rollouts_per_step": n_prompts * G, "completion_len_mean": float(np.mean(completion_lens)),
          "reward_mean": float(np.mean(rewards_all)), "prompt_width": P, "remat": cfg.remat_config.name,
          **({"note": note} if note else {}),
          "tunix_version": getattr(tunix, "__version__", "?"), "jax_version": jax.__version__}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workload", required=True)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
  ap.add_argument("--rounds", type=int, default=1, help="blocks of --steps, each after a pause (when > 1)")
  ap.add_argument("--model", default="", help="HF folder (workloads R / R_small)")
  args = ap.parse_args()
  try:
    import tunix  # noqa: F401
  except Exception as e:  # noqa: BLE001 -- any import failure is reported, not raised
    _emit({"status": f"tunix not importable: {type(e).__name__}: {e}"[:300]})
    return
  try:
    from bench import workloads
    fn = (lambda *a: run_real(args.workload, args.model, *a)) if args.workload in workloads.REAL else (
        lambda *a: run(args.workload, *a))
    result = fn(max(args.warmup, 1), args.steps, max(args.rounds, 1))
  except Exception as e:  # noqa: BLE001 -- the table shows why the peer could not run
    traceback.print_exc(file=sys.stderr)
    result = {"status": f"tunix run failed: {type(e).__name__}: {e}"[:300]}
  _emit(result)


if __name__ == "__main__":
  main()
