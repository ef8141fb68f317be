"""The model shapes the benchmarks run, shared by our side and the peer scripts (plain dicts, no jax)."""

# Learner MFU configs (issue #9): S and M.
LEARNER = {
    "S": {"model": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512, vocab_size=256, layer_unroll=2),
          "batch": 32, "seq_len": 24, "prompt_len": 8},
    "M": {"model": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=1024, vocab_size=512, layer_unroll=4),
          "batch": 64, "seq_len": 128, "prompt_len": 32},
}
# M with the layer scan rolled (one compiled body for its first three layers; the last layer runs on
# its own because the learner skips its prompt-position outputs): the layer_unroll cost, same run.
LEARNER["M, layer_unroll=1"] = {**LEARNER["M"], "model": {**LEARNER["M"]["model"], "layer_unroll": 1}}

# Full GRPO step against Tunix: Qwen3-style (q/k RMSNorm), character tokenizer, 2-digit "ab+cd=" prompts.
GRPO = {
    "2L-d128": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512, vocab_size=256, layer_unroll=2),
    "4L-d256": dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=1024, vocab_size=256, layer_unroll=4),
}
GRPO_RUN = dict(prompts_per_step=8, group_size=4, max_new_tokens=16, beta=0.04, lr=1e-4, temperature=1.0,
                epsilon=0.2, num_digits=2, seed=0)

# Sampler throughput: model M, prompts of SAMPLER_PROMPT_LEN tokens.
SAMPLER_MODEL = LEARNER["M"]["model"]
SAMPLER_PROMPT_LEN = 32
SAMPLER_BATCHES = (32, 128)
SAMPLER_NEW_TOKENS = (16, 128)

# Workload R (issue 17): the GRPO step on the real SmolLM2-135M-Instruct, chat-templated "What is
# 47 + 38? ..." prompts (task arithmetic_chat), k3 KL to the initial weights, one update per batch, fp32.
# R_small is what a 2-core CPU runs in `make bench`; R (`python -m bench.run --real R`) is the full size.
# remat: "full" recomputes each layer in the backward pass: what configs/smollm2_grpo.py's "auto" takes on a CPU
# (`memory.REMAT_ORDER`), and what the peers are told to match (torch's gradient checkpointing, Tunix's remat).
REAL = {
    # tunix_micro_prompts: Tunix (which cannot recompute layers here: bench/peers/tunix_grpo.py) trains and scores
    # R in micro-batches of this many prompts' groups (its own `train_micro_batch_size`); in one batch of 64 rows
    # its step asks for 31.7 GB (measured: out of memory on this 23 GB machine). Its rollouts stay one batch.
    "R": dict(prompts_per_step=8, group_size=8, max_new_tokens=128, remat="full", tunix_micro_prompts=2),
    "R_small": dict(prompts_per_step=4, group_size=4, max_new_tokens=64, remat="full"),
}  # remat as the SmolLM2 configs' `model.remat` ("auto" is decided as a run decides it: `grpo_real._remat`)
REAL_RUN = dict(beta=0.04, lr=1e-5, temperature=1.0, epsilon=0.2, num_digits=2, seed=0, layer_unroll=1)
