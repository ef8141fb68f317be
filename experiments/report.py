"""Generates docs/RESULTS.md and docs/figures/*.png from experiments/results/*.json.

    python -m experiments.report            # or: python experiments/report.py

Nothing in RESULTS.md is typed by hand: every number comes from the results files and every
"reproduces / does not reproduce" verdict from the explicit rules in `CLAIMS` below, applied to
those numbers. Accuracy is `eval_accuracy_late` (mean of a run's last three held-out greedy
evaluations), aggregated over seeds as mean ± standard error (s.e. = std/√n, n seeds, shown as
"(n=…)").

Rules (constants below):
- a metric *drops* when mean(a) − mean(b) > MARGIN and, with ≥ 2 seeds on both sides, also
  > 2 · sqrt(se_a² + se_b²) (se = std/√n). With one seed the verdict is marked "1 seed".
- RL *learns* at lag 0 (the precondition of every staleness claim on the real model) when the lag-0
  baseline's late accuracy exceeds its initial accuracy by more than MARGIN and, with ≥ 2 seeds,
  by more than 2 standard errors of the per-seed gains.
- a method is *stable* under staleness when its accuracy at the largest lag falls by at most MARGIN
  relative to lag 0; it is not stable when it drops (as above); in between (a fall past the margin
  that the seeds' standard errors cover) the verdict is "undecided at this noise", not "stable".
  The same three-way rule, with KL_GROWTH, decides an OPD arm "stays robust" under lag.
- "X stays stable where GRPO degrades" is testable only when GRPO itself drops; otherwise the
  verdict is "not testable here".
- "X beats GRPO under staleness" (the real grid, at each stale lag) holds when X's accuracy exceeds
  GRPO's as a drop would (MARGIN and 2 se); past the margin but inside 2 se it is "undecided at this
  noise"; within the margin it does not reproduce.
- replay (B7) "reaches the same accuracy with less compute" when some replay arm's accuracy does
  not drop relative to no replay while it generated ≤ (1 − REPLAY_SAVING) of its groups; it "helps
  per unit of compute" when some replay arm's accuracy at the cheapest arm's budget (generated
  groups, or training seconds) is higher than no replay's there by more than the margin.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import sys

if __package__ in (None, ""):  # `python experiments/report.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

MARGIN = 0.03  # absolute held-out accuracy: below one eval's binomial noise at n=256 is not a drop
RATIO_MUCH_SMALLER = 0.5  # "A ≪ B" means A < 0.5 · B
SPEEDUP = 1.5  # "faster" means ≥ 1.5× steps/s
IDLE_GAIN = 0.10  # "less idle" means an idle fraction lower by ≥ 0.10
REPLAY_SAVING = 0.25  # "less compute" means ≤ 75% of the no-replay run's generated groups
ACC = "eval_accuracy_late"
HEADLINE_CHANGED = 0.01  # SparseRL-Sync's headline: ≈99 % of bf16 weights unchanged per step
PR2_KL_MARGIN = 0.10  # PR2 "lowers" KL(μ ‖ π_θ): by more than 10% of R3's (and 2 se)
KL_GROWTH = 0.10  # a KL "grows" when its mean rises by > 10% of the reference (and 2 combined se with seeds)


# ----------------------------------------------------------------------------- statistics

def stats(xs) -> dict | None:
  """{mean, std, n, se} of the finite values, or None."""
  xs = [float(x) for x in xs if x is not None and math.isfinite(x)]
  if not xs:
    return None
  m = sum(xs) / len(xs)
  sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
  return {"mean": m, "std": sd, "n": len(xs), "se": sd / math.sqrt(len(xs))}


def fmt(s: dict | None, digits: int = 3) -> str:
  """mean ± standard error (n seeds), or the single value."""
  if s is None:
    return "—"
  if s["n"] > 1:
    return f"{s['mean']:.{digits}f} ± {s['se']:.{digits}f} (n={s['n']})"
  return f"{s['mean']:.{digits}f}"


def drops(a: dict | None, b: dict | None, margin: float = MARGIN) -> bool | None:
  """Whether a's mean exceeds b's by more than the margin (and 2 combined standard errors with seeds)."""
  if a is None or b is None:
    return None
  d = a["mean"] - b["mean"]
  if a["n"] > 1 and b["n"] > 1:
    return d > margin and d > 2 * math.sqrt(a["se"] ** 2 + b["se"] ** 2)
  return d > margin


def grows(a: dict | None, b: dict | None, rel: float = KL_GROWTH) -> bool | None:
  """Whether b's mean exceeds a's by more than rel · |a| (and 2 combined standard errors with seeds)."""
  if a is None or b is None:
    return None
  return drops(b, a, margin=rel * abs(a["mean"]))


UNDECIDED = "undecided"  # a verdict: the point estimate says one thing, the seeds' noise covers it


def exceeds(a: dict | None, b: dict | None, margin: float = MARGIN) -> bool | str | None:
  """Whether a's mean exceeds b's (a "beats" claim), three-way like `stays_within`: True past the margin and 2
  combined standard errors (`drops(a, b)`), False within the margin, UNDECIDED past the margin but within the
  noise (more seeds decide it)."""
  if a is None or b is None:
    return None
  if drops(a, b, margin):
    return True
  return UNDECIDED if a["mean"] - b["mean"] > margin else False


def stays_within(a: dict | None, b: dict | None, margin: float) -> bool | str | None:
  """Whether b's mean stays within `margin` above a's (a stability claim, the reverse of `drops`).

  False when b exceeds a by more than the margin and 2 combined standard errors (`drops(b, a)`); True when
  it exceeds a by at most the margin; UNDECIDED in between: the mean moved past the margin but within the
  noise, so "no significant change" would read noise as stability, and more seeds decide it. That is
  `exceeds(b, a)` negated, UNDECIDED kept.
  """
  moved = exceeds(b, a, margin)
  return moved if moved in (None, UNDECIDED) else not moved


def paired(runs, key: str, a, b, metric: str = ACC) -> dict | None:
  """Stats of the per-seed differences metric(a) − metric(b) over the seeds where both arms (`run[key]`) ran:
  arms that start from each seed's same warm start compare within the seed, which removes the spread between
  warm starts from the noise."""
  return paired_cells(runs, {key: a}, {key: b}, metric)


def paired_cells(runs, a: dict, b: dict, metric: str = ACC) -> dict | None:
  """`paired` for cells named by several fields: a, b = {field: value} (e.g. method and lag). A seed pairs only
  where both runs started from the same policy (equal `eval_accuracy_initial` when both have one): runs of one
  seed made on different machines or commits can start from different warm starts."""
  pick = lambda m: {r["seed"]: r["summary"] for r in runs if "summary" in r and all(r.get(k) == v for k, v in m.items())}
  A, B = pick(a), pick(b)
  start = lambda s: s.get("eval_accuracy_initial")
  same = lambda x, y: start(x) is None or start(y) is None or start(x) == start(y)
  return stats([A[k].get(metric) - B[k].get(metric) for k in A if k in B and A[k].get(metric) is not None
                and B[k].get(metric) is not None and same(A[k], B[k])])


def exceeds_paired(d: dict | None, margin: float = MARGIN) -> bool | str | None:
  """`exceeds` on paired differences `d` (`paired`): True when their mean is past the margin and 2 standard errors
  (the margin alone with one seed), UNDECIDED past the margin but within the noise, else False."""
  if d is None:
    return None
  if d["mean"] > margin and (d["n"] < 2 or d["mean"] > 2 * d["se"]):
    return True
  return UNDECIDED if d["mean"] > margin else False


def within_paired(d: dict | None, margin: float = MARGIN) -> bool | str | None:
  """`stays_within` on paired differences `d` = a − b: b does not exceed a by more than the margin."""
  if d is None:
    return None
  moved = exceeds_paired(flip(d), margin)
  return moved if moved in (None, UNDECIDED) else not moved


def flip(d: dict | None) -> dict | None:
  """Differences a − b (`paired`) as b − a."""
  return None if d is None else {**d, "mean": -d["mean"]}


def gain(runs) -> dict | None:
  """Stats of held-out accuracy late − initial over the runs (one per seed): what RL moved the policy by."""
  return stats([r["summary"][ACC] - r["summary"]["eval_accuracy_initial"] for r in runs if "summary" in r
                and r["summary"].get(ACC) is not None and r["summary"].get("eval_accuracy_initial") is not None])


def _unpaired(a: dict | None, b: dict | None) -> dict | None:
  """a − b for two independent cells, in `paired`'s shape (mean, combined se, the smaller n): `exceeds_paired` of it
  is `exceeds(a, b)`."""
  if a is None or b is None:
    return None
  return {"mean": a["mean"] - b["mean"], "se": math.sqrt(a["se"] ** 2 + b["se"] ** 2), "n": min(a["n"], b["n"])}


def seeds_note(*ss) -> str:
  return " (1 seed: indicative only)" if any(s is not None and s["n"] < 2 for s in ss) else ""


def cell(runs, metric: str = ACC, **match) -> dict | None:
  """Stats of `summary[metric]` over the runs matching every `key=value`."""
  return stats([r["summary"].get(metric) for r in runs if "summary" in r
                and all(r.get(k) == v for k, v in match.items())])


TRUST_WORDS = ("clip", "mask", "capped", "truncated", "out_of_band", "filtered", "drop")


def trust_frac(summary: dict) -> float | None:
  """Fraction of tokens a loss clipped or masked: the largest of its clip / mask `*_frac` means (None when it
  reports none). Other fractions (the learner's padding, sparse sync's changed weights, S²D's kept states) are not
  a trust region's."""
  vals = [v for k, v in summary.items() if k.endswith("_frac_mean") and v is not None
          and any(w in k for w in TRUST_WORDS)]
  return max(vals) if vals else None


# ----------------------------------------------------------------------------- loading

def load(results_dir: str) -> dict:
  out = {}
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    with open(path) as f:
      doc = json.load(f)
    out[doc.get("experiment", os.path.splitext(os.path.basename(path))[0])] = doc
  return out


def planned_seeds(doc: dict):
  """The seeds of the grid: from its planned cells when the file accumulates (`common.run_cells`: its
  `seeds` field is the last invocation's), else the file's own `seeds`."""
  planned = doc.get("planned")
  return len({p["seed"] for p in planned}) if planned else doc.get("seeds")


def provenance(doc: dict) -> str:
  """Command, setting, commit, machine and time of a results document; a field it lacks is left out (a
  document with none of them says so) rather than printed as a placeholder."""
  m = doc.get("machine") or {}
  parts = [f"Command: `{doc['command']}`" if doc.get("command") else None,
           f"setting `{doc['setting']}`" if doc.get("setting") else None,
           f"commit `{doc['commit']}`" if doc.get("commit") else None,
           (f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, JAX {m.get('jax', '?')} "
            f"({m.get('backend', '?')})") if m else None,
           f"finished {doc['finished_utc']}" if doc.get("finished_utc") else None]
  parts = [x for x in parts if x]
  return " · ".join(parts) if parts else "No provenance recorded (the file predates `common.write_results`)."


# ----------------------------------------------------------------------------- plots

def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _smooth(xs, w=5):
  out, acc = [], []
  for x in xs:
    acc.append(x)
    acc = acc[-w:]
    out.append(sum(acc) / len(acc))
  return out


def plot_acc_vs_lag(runs, task, ms, lags, path):
  plt = _plt()
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, m in enumerate(ms):
    pts = [(lag, cell(runs, task=task, method=m, lag=lag)) for lag in lags]
    pts = [(lag, s) for lag, s in pts if s is not None]
    if pts:  # 20 distinct colours and alternating markers: up to 16 methods share one axis
      ax.errorbar([str(p[0]) for p in pts], [p[1]["mean"] for p in pts], yerr=[p[1]["std"] for p in pts],
                  marker="osD^v"[i % 5], color=plt.cm.tab20(i % 20), capsize=3, label=m,
                  lw=2.5 if m == "grpo" else 1)
  ax.set_xlabel("fixed lag k (learner updates)")
  ax.set_ylabel("held-out accuracy (late)")
  ax.set_title(f"Staleness ablation: {task}")
  ax.legend(fontsize=6, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_curves(runs, task, method, lags, path):
  plt = _plt()
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
  for lag in lags:
    rs = [r for r in runs if r.get("task") == task and r.get("method") == method and r.get("lag") == lag
          and "curves" in r]
    if not rs:
      continue
    c = rs[0]["curves"]
    a1.plot(c["step"], _smooth(c["reward_mean"], 10), label=f"lag {lag}")
    a2.plot(c["eval_step"], c["eval_accuracy"], marker="o", label=f"lag {lag}")
  a1.set_title(f"{method} on {task}: train reward (smoothed, seed 0)")
  a2.set_title("held-out accuracy")
  for a in (a1, a2):
    a.set_xlabel("learner step")
    a.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_bars(labels, groups: dict, ylabel, title, path):
  """Grouped bars: groups = {series name: [value per label]}."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(labels) * len(groups)), 3.8))
  w = 0.8 / max(1, len(groups))
  for i, (name, vals) in enumerate(groups.items()):
    ax.bar([j + i * w for j in range(len(labels))], [v if v is not None else 0 for v in vals], w, label=name)
  ax.set_xticks([j + 0.4 - w / 2 for j in range(len(labels))])
  ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- sections

def staleness_section(doc, fig_dir, rel, real: bool = False) -> tuple[list[str], list[dict]]:
  runs = doc["runs"]
  ms = list(doc["methods"])
  base = doc.get("baseline", "grpo")
  start = ("Every run starts from the pretrained checkpoint (no SFT warm start)." if real else
           "Every run of a (task, seed) starts from the same SFT warm start.")
  title = f"## Staleness on the real model: {doc.get('model')} (`fixed_lag`)" if real else \
      "## Staleness ablation (`fixed_lag`)"
  lines = [title, "", provenance(doc), "",
           f"Learner steps per run: {doc.get('steps')}; seeds: {planned_seeds(doc)}; shared overrides: "
           f"`{json.dumps(doc.get('base_overrides'))}`. {start} Cells: held-out greedy accuracy, mean of the last "
           f"three evaluations (mean ± standard error over seeds). {_is_note(doc)}", ""]
  claims = []
  for task in sorted({r["task"] for r in runs}):
    tr = [r for r in runs if r["task"] == task]
    lags = sorted({r["lag"] for r in tr})
    tms = [m for m in ms if any(r["method"] == m for r in tr)]
    init = stats(list({r["seed"]: r["summary"]["eval_accuracy_initial"] for r in tr if "summary" in r}.values()))
    lines += [f"### {task}", "", f"Accuracy {'of the checkpoint' if real else 'after the SFT warm start'} "
              f"(before RL): {fmt(init)}.", "",
              "| method | " + " | ".join(f"lag {k}" for k in lags) + " |", "|---|" + "---|" * len(lags)]
    for m in tms:
      lines.append(f"| {m} | " + " | ".join(fmt(cell(tr, method=m, lag=k)) for k in lags) + " |")
    version0 = start_model_batches(doc["steps"], lags) if doc.get("steps") else ""
    if version0:
      lines += ["", version0]
    same = same_trajectory(tr, base, min(lags))
    if same:
      lines += ["", f"At lag {min(lags)}, {', '.join(same)} ran {base}'s trajectory exactly (identical reward and "
                "held-out accuracy curves on every seed both have): there they make the same on-policy update, so "
                "those cells carry no information of their own."]
    kmax = max(lags)
    lines += ["", f"Diagnostics at lag {kmax} (means over steps, then over seeds): importance-ratio tails, "
              "fraction of tokens clipped or masked by the loss (largest `*_frac` it reports), KL(μ‖π_θ) k3.", "",
              "| method | ratio max | ratio p99 (max over steps) | clipped/masked frac | KL k3 | runs with errors |",
              "|---|---|---|---|---|---|"]
    for m in tms:
      rs = [r for r in tr if r["method"] == m and r["lag"] == kmax]
      ok = [r for r in rs if "summary" in r]
      lines.append(f"| {m} | {fmt(stats([r['summary']['ratio_max'] for r in ok]), 2)} | "
                   f"{fmt(stats([r['summary']['ratio_p99_max'] for r in ok]), 2)} | "
                   f"{fmt(stats([trust_frac(r['summary']) for r in ok]))} | "
                   f"{fmt(stats([r['summary']['kl_mu_k3_mean'] for r in ok]), 4)} | {len(rs) - len(ok)} |")
    f1 = f"staleness_{task}_acc_vs_lag.png"
    plot_acc_vs_lag(tr, task, tms, lags, os.path.join(fig_dir, f1))
    f2 = f"staleness_{task}_{base}_curves.png"
    plot_curves(tr, task, base, lags, os.path.join(fig_dir, f2))
    lines += ["", f"![accuracy vs lag]({rel}/{f1})", "", f"![{base} curves]({rel}/{f2})", ""]
    lines += missing_cells(doc, ("method", "lag"), lambda m, k: f"{m} lag {k}", task=task)
    if real:
      lines += ["Each claim is asked at every stale lag with results; any planned cells still missing are listed above.", ""]
      claims.append(learns_claim(tr, task, base, min(lags)))
    claims += staleness_claims(tr, task, base, lags, real)
  return lines, claims


def start_model_batches(steps: int, lags) -> str:
  """How much of a `fixed_lag` run the start model generates: learner step t trains on version max(0, t − k),
  so the first min(k + 1, steps) batches come from version 0."""
  parts = [f"lag {k}: {min(k + 1, steps)} of {steps}" for k in lags if k > 0]
  return ("" if not parts else f"Batches generated by the start model (version 0; step t trains on version "
          f"max(0, t − k)): {'; '.join(parts)}.")


def same_trajectory(tr, base, lag) -> list[str]:
  """The methods whose runs at `lag` have exactly `base`'s reward and held-out accuracy curves on every seed both
  ran (at least one): deterministic runs that made the same updates."""
  trace = lambda r: (r.get("curves", {}).get("reward_mean"), r.get("curves", {}).get("eval_accuracy"))
  by = {(r["method"], r["seed"]): trace(r) for r in tr if r["lag"] == lag and "summary" in r}
  out = []
  for m in dict.fromkeys(m for m, _ in by):
    seeds = [s for mm, s in by if mm == m and (base, s) in by]
    if m != base and seeds and all(by[(m, s)] == by[(base, s)] and by[(m, s)][0] for s in seeds):
      out.append(m)
  return out


def missing_cells(doc, group: tuple[str, ...], label, **match) -> list[str]:
  """The planned runs (those matching every `key=value`) with no result yet, by their `group` fields with
  their seeds (results that accumulate across invocations); `label(*group values)` names a group."""
  key = lambda r: tuple(r[f] for f in group) + (r["seed"],)
  ok = lambda r: all(r.get(k) == v for k, v in match.items())
  have = {key(r) for r in doc["runs"] if "summary" in r and ok(r)}
  by: dict = {}
  for p in doc.get("planned", []):
    if ok(p) and key(p) not in have:
      by.setdefault(key(p)[:-1], []).append(p["seed"])
  if not by:
    return []
  return [f"Planned cells still missing ({sum(map(len, by.values()))} runs; rerun the command to fill them): "
          + "; ".join(f"{label(*g)} seeds {sorted(ss)}" for g, ss in by.items()) + ".", ""]


def learns_claim(tr, task, base, k0) -> dict:
  """The precondition: the lag-0 baseline gains held-out accuracy from RL (late − initial, per seed)."""
  rs = [r for r in tr if r["method"] == base and r["lag"] == k0 and "summary" in r]
  g = gain(rs)
  ok = None
  if g is not None:
    ok = g["mean"] > MARGIN and (g["n"] < 2 or g["mean"] > 2 * g["se"])
  return claim(f"RL improves the real model at lag 0 ({task}; precondition of the staleness claims)",
               "this library", ok, f"{base} gain late − initial: {fmt(g)}" + seeds_note(g))


def _is_note(doc) -> str:
  """What π_old/μ means for the importance-sampling corrections of a staleness grid (from its recorded methods)."""
  ms, is_methods = doc.get("methods", {}), ("tis", "mis", "icepop")
  step_start = [m for m in is_methods if ms.get(m, {}).get("rollout.old_logp") == "step_start"]
  rest = [m for m in is_methods if m not in step_start]
  names = lambda xs: ", ".join(f"`{m}`" for m in xs)
  verb = lambda xs, v: v if len(xs) == 1 else v[:-1]  # "corrects" / "correct"
  out = [f"{names(rest)} {verb(rest, 'corrects')} π_old/μ (train/inference mismatch); with an fp32 sampler and "
         "π_old recomputed at the behaviour version that ratio is 1, so here they coincide with their PPO-clip base "
         "(see the mismatch ablation for where they differ)."] if rest else []
  if step_start:
    out.append(f"{names(step_start)} {verb(step_start, 'scores')} π_old with the learner's parameters at the start of "
               "the step (`rollout.old_logp=step_start`, as verl recomputes `old_log_prob` with the current actor), "
               "so the truncated weight min(π_old/μ, C) corrects the staleness.")
  return " ".join(out)


def staleness_claims(tr, task, base, lags, real: bool = False) -> list[dict]:
  """The staleness claims from lag 0 to the largest lag; the real grid (cells filled run by run, lags of
  different depth) asks them at every stale lag with results."""
  lags = sorted(set(lags))
  if len(lags) < 2:  # one lag so far (results that accumulate): nothing to compare
    return []
  return [c for k in (lags[1:] if real else lags[-1:]) for c in _staleness_claims_at(tr, task, base, lags[0], k, real)]


def _staleness_claims_at(tr, task, base, k0: int, kmax: int, real: bool) -> list[dict]:
  """The tiny grids compare on per-seed differences (`paired_cells`): the cells of a seed share that seed's SFT warm
  start, whose spread between seeds would otherwise swamp the differences. The real grid's runs all start from one
  checkpoint (nothing per seed to remove), so it compares the cells' means (`exceeds`, `stays_within`)."""
  out = []
  b0, bk = cell(tr, method=base, lag=k0), cell(tr, method=base, lag=kmax)
  pair = lambda m1, l1, m2, l2: paired_cells(tr, {"method": m1, "lag": l1}, {"method": m2, "lag": l2})
  if real:  # unpaired: the stats of (a − b) as a plain record of the two cells' means and combined se
    pair = lambda m1, l1, m2, l2: _unpaired(cell(tr, method=m1, lag=l1), cell(tr, method=m2, lag=l2))
  per = "difference of means" if real else "per-seed difference"
  d_base = pair(base, k0, base, kmax)
  degrades = exceeds_paired(d_base)  # three-way: a fall past the margin but within 2 se is undecided, not "no"
  base_drops = degrades is True
  out.append(claim(
      f"GRPO degrades as staleness grows ({task}, lag {k0} → {kmax})", "M2PO / VESPO papers; methods-rl §9.2",
      degrades, f"{base}: {fmt(b0)} at lag {k0} vs {fmt(bk)} at lag {kmax}; {per} {fmt(d_base)}"
      + seeds_note(b0, bk)))
  for m, paper in (("m2po", "M2PO (arXiv 2510.01161)"), ("vespo", "VESPO (arXiv 2602.10693)"),
                   ("dppo", "DPPO (arXiv 2602.04879)")):
    a0, ak = cell(tr, method=m, lag=k0), cell(tr, method=m, lag=kmax)
    if a0 is None or ak is None:
      continue
    d = pair(m, kmax, m, k0)
    stable = within_paired(d)  # the accuracy at lag kmax falls by at most the margin (per seed)
    # A correction that falls is unstable whatever the baseline did; one that holds answers only where GRPO falls.
    verdict = stable if base_drops or stable is False else None
    evidence = f"{m}: {fmt(a0)} → {fmt(ak)} ({per} {fmt(d)}); {base}: {fmt(b0)} → {fmt(bk)}" + seeds_note(a0, ak)
    if verdict == UNDECIDED:
      evidence += f"; undecided: {m} falls by more than {MARGIN} but within 2 se"
    if verdict is None:
      evidence += f"; not testable here: the {base} baseline did not degrade" + (
          " past 2 se" if degrades == UNDECIDED else "")
    out.append(claim(f"{m} stays stable where GRPO degrades ({task}, lag {kmax})", paper, verdict, evidence))
  # The real grid also asks it at the stale lag alone (a correction whose lag-0 cells have not run yet still
  # answers it): does the correction beat GRPO there, by the margin and 2 standard errors of the per-seed gaps?
  for m, paper in () if not real else (("m2po", "M2PO (arXiv 2510.01161)"), ("vespo", "VESPO (arXiv 2602.10693)"),
                   ("dppo", "DPPO (arXiv 2602.04879)"), ("decoupled_ppo", "AReaL (decoupled PPO)"),
                   ("tis", "TIS; methods-rl §9.1")):
    ak = cell(tr, method=m, lag=kmax)
    if ak is None or bk is None:
      continue
    d = pair(m, kmax, base, kmax)
    better = exceeds_paired(d)
    evidence = (f"{m} {fmt(ak)} vs {base} {fmt(bk)} at lag {kmax}; {per} {fmt(d)} (rule: higher by > "
                f"{MARGIN} and 2 se)" + seeds_note(ak, bk))
    if base_drops and better == UNDECIDED:
      evidence += f"; undecided: {m} is higher by more than {MARGIN} but within 2 se"
    if not base_drops:
      evidence += f"; not testable here: the {base} baseline did not degrade" + (
          " past 2 se" if degrades == UNDECIDED else "")
    out.append(claim(f"{m} beats GRPO under staleness ({task}, lag {kmax})", paper,
                     better if base_drops else None, evidence))
  g = [trust_frac(r["summary"]) for r in tr if r["method"] == base and r["lag"] == kmax and "summary" in r]
  mm = [trust_frac(r["summary"]) for r in tr if r["method"] == "m2po" and r["lag"] == kmax and "summary" in r]
  gs, ms_ = stats(g), stats(mm)
  if gs and ms_:
    out.append(claim(f"M2PO masks far fewer tokens than GRPO clips ({task}, lag {kmax})", "M2PO; methods-rl §9.2",
                     ms_["mean"] < RATIO_MUCH_SMALLER * gs["mean"],
                     f"m2po masked {fmt(ms_)} vs {base} clipped {fmt(gs)} (rule: < {RATIO_MUCH_SMALLER}×)"))
  d0, dk = cell(tr, method="decoupled_ppo", lag=kmax), cell(tr, method="a3po", lag=kmax)
  if d0 and dk:
    d = pair("a3po", kmax, "decoupled_ppo", kmax)
    both = (within_paired(d), within_paired(flip(d)))  # neither above the other
    v = False if False in both else UNDECIDED if UNDECIDED in both else both[0]
    out.append(claim(f"A-3PO matches decoupled PPO's accuracy ({task}, lag {kmax})", "A-3PO; methods-rl §4.2", v,
                     f"a3po {fmt(dk)} vs decoupled_ppo {fmt(d0)}; {per} {fmt(d)} (rule: neither "
                     f"above by > {MARGIN})" + seeds_note(d0, dk)))
  return out


def mismatch_section(doc, fig_dir, rel, real: bool = False, start: dict | None = None) -> tuple[list[str], list[dict]]:
  """Accuracy by sampler precision and correction. A correction with no fp32 cell of its own (the real
  model's CPU grid) is compared with uncorrected PG's fp32 cell: on-policy with an fp32 sampler they are
  the same update (ρ = 1 up to float noise). `start`: the `mismatch_real` document (the start model rescored),
  to set the fractions MIS and IcePop mask in training beside the start model's."""
  runs = doc["runs"]
  title = "## Train/inference mismatch (bf16 sampler vs fp32 learner)"
  if real:
    title = f"## Train/inference mismatch in training, on the real model: {doc.get('model')}"
  lines = [title, "", provenance(doc), "",
           f"Learner steps per run: {doc.get('steps')}; seeds: {planned_seeds(doc)}; shared overrides: "
           f"`{json.dumps(doc.get('base_overrides'))}`.", ""]
  for task, av in doc.get("availability", {}).items():
    for s, why in av.items():
      if why is not None:
        lines.append(f"- {task}, sampler `{s}`: {why}")
  lines.append("")
  claims = []
  for task in sorted({r["task"] for r in runs}):
    tr = [r for r in runs if r["task"] == task and "summary" in r]
    samplers = [s for s in doc["samplers"] if any(r["sampler"] == s for r in tr)]
    ms = [m for m in doc["methods"] if any(r["method"] == m for r in tr)]
    lines += [f"### {task}", "", "| method | " + " | ".join(
        f"acc ({s}) | mean abs(log π_old − log μ) ({s}) | masked/clipped ({s})" for s in samplers) + " |",
        "|---|" + "---|---|---|" * len(samplers)]
    for m in ms:
      cells = []
      for s in samplers:
        rs = [r for r in tr if r["method"] == m and r["sampler"] == s]
        cells += [fmt(cell(rs)), fmt(stats([r["summary"]["mismatch_abs_mean"] for r in rs]), 5),
                  fmt(stats([trust_frac(r["summary"]) for r in rs]))]
      lines.append(f"| {m} | " + " | ".join(cells) + " |")
    fname = f"mismatch_{task}.png"
    plot_bars(ms, {s: [(cell([r for r in tr if r["method"] == m and r["sampler"] == s]) or {}).get("mean")
                       for m in ms] for s in samplers}, "held-out accuracy (late)", f"Sampler precision: {task}",
              os.path.join(fig_dir, fname))
    lines += ["", f"![mismatch]({rel}/{fname})", ""]
    lines += _start_vs_training(tr, (start or {}).get("variants", {}).get("bfloat16"))
    if {"fp32", "bf16"} <= set(samplers) and "pg" in ms:
      p32, p16 = cell([r for r in tr if r["method"] == "pg" and r["sampler"] == "fp32"]), \
          cell([r for r in tr if r["method"] == "pg" and r["sampler"] == "bf16"])
      gap = stats([r["summary"]["mismatch_abs_mean"] for r in tr if r["sampler"] == "bf16"])
      pg_hurt = drops(p32, p16)
      flat = {m: not drops(cell([r for r in tr if r["method"] == m and r["sampler"] == "fp32"]) or p32,
                           cell([r for r in tr if r["method"] == m and r["sampler"] == "bf16"]))
              for m in ("tis", "mis", "icepop") if m in ms}
      ev = (f"pg {fmt(p32)} (fp32) → {fmt(p16)} (bf16); measured mismatch {fmt(gap, 5)}; corrections flat: "
            + ", ".join(f"{m}={v}" for m, v in flat.items()) + seeds_note(p32, p16))
      claims.append(claim(f"bf16 sampling hurts uncorrected PG while TIS / MIS / IcePop stay flat ({task})",
                          "TIS / MIS / IcePop; methods-rl §9.1", bool(pg_hurt) and all(flat.values()), ev))
    lines += missing_cells(doc, ("sampler", "method"), lambda smp, m: f"{m} ({smp} sampler)", task=task)
  return lines, claims


def _start_vs_training(tr, start_bf16: dict | None) -> list[str]:
  """A sentence setting the fraction of tokens outside IcePop's / MIS's band at the start model (bf16 sampler)
  beside the fraction each masked in training (bf16), when both were measured."""
  masked = {m: stats([trust_frac(r["summary"]) for r in tr if r["method"] == m and r["sampler"] == "bf16"])
            for m in ("icepop", "mis")}
  if start_bf16 is None or None in masked.values():
    return []
  out = {"icepop": start_bf16["icepop_out_frac"], "mis": start_bf16["mis_out_frac"]}
  more = all(masked[m]["mean"] > out[m] for m in masked)
  gap = stats([r["summary"]["mismatch_abs_mean"] for r in tr if r["sampler"] == "bf16"])
  return [f"Start model vs training (bf16 sampler): rescoring the start model puts {out['icepop']:.4f} of its tokens "
          f"outside IcePop's band and {out['mis']:.4f} outside MIS's (mean |Δ| {start_bf16['abs_mean']:.2e}); in "
          f"training icepop masked {fmt(masked['icepop'])} and mis {fmt(masked['mis'])} of tokens, at a mean "
          f"|Δ| of {fmt(gap, 5)}" + (": the bands are crossed more once the policy has moved from its start." if more
                                         else "."), ""]


def throughput_section(doc, fig_dir, rel, real: bool = False) -> tuple[list[str], list[dict]]:
  runs = [r for r in doc["runs"] if "timing" in r]
  title = "## Throughput: wall-clock per learner step and learner idle fraction"
  if real:
    title += f" ({doc.get('model', 'the real model')})"
  lines = [title, "", provenance(doc), "",
           f"Timed steps per run: {doc.get('steps')} minus the first {doc.get('skip')} (compilation); repeats: "
           f"{doc.get('repeats')}. Idle = time the learner waits for rollouts (generation in the single-threaded "
           "modes, buffer wait in async). CPU timings on a shared machine are noisy: compare ratios.", ""]
  for m, a in doc.get("availability", {}).items():
    if a != "available":
      lines.append(f"- `{m}`: {a}")
  modes = [m for m in doc["modes"] if any(r["mode"] == m for r in runs)]
  lines += ["", "| mode | lag / η | s per learner step | idle s per step | idle fraction | learner steps/s |",
            "|---|---|---|---|---|---|"]
  st = {}
  for m in modes:
    rs = [r for r in runs if r["mode"] == m]
    st[m] = {k: stats([r["timing"][k] for r in rs]) for k in ("time_step_s", "time_idle_s", "idle_frac", "steps_per_s")}
    lines.append(f"| {m} | {rs[0]['lag']} | {fmt(st[m]['time_step_s'])} | {fmt(st[m]['time_idle_s'])} | "
                 f"{fmt(st[m]['idle_frac'])} | {fmt(st[m]['steps_per_s'], 2)} |")
  if modes:
    fname = "throughput_smollm2.png" if real else "throughput.png"
    plot_bars(modes, {"learner busy s": [st[m]["time_step_s"]["mean"] - st[m]["time_idle_s"]["mean"] for m in modes],
                      "learner idle s": [st[m]["time_idle_s"]["mean"] for m in modes]},
              "seconds per learner step", "Wall-clock per learner step", os.path.join(fig_dir, fname))
    lines += ["", f"![throughput]({rel}/{fname})", ""]
  claims = []
  if "sync" in st and "staged" in st:
    sp = st["staged"]["steps_per_s"]["mean"] / st["sync"]["steps_per_s"]["mean"]
    lag = next(r["lag"] for r in runs if r["mode"] == "staged")
    claims.append(claim(f"A staged schedule (stages of {lag} steps, `{doc.get('base_overrides', {}).get('loss.name')}`; "
                        "μ-GRPO itself: its own section) trains faster in wall-clock than sync",
                        "μ-GRPO (arXiv 2605.17570)", sp >= SPEEDUP,
                        f"staged/sync learner steps/s = {sp:.2f} (rule: ≥ {SPEEDUP})"))
  if "sync" in st and "async" in st:
    d = st["sync"]["idle_frac"]["mean"] - st["async"]["idle_frac"]["mean"]
    claims.append(claim("Asynchronous rollouts cut learner idle time" + (" (real model)" if real else ""), "AReaL; DESIGN §3",
                        d >= IDLE_GAIN, f"idle fraction sync {fmt(st['sync']['idle_frac'])} vs async "
                        f"{fmt(st['async']['idle_frac'])} (rule: lower by ≥ {IDLE_GAIN})"))
    sp = st["async"]["steps_per_s"]["mean"] / st["sync"]["steps_per_s"]["mean"]
    lines += [f"async / sync learner steps per second: {sp:.2f}. Here the rollout workers and the learner share "
              "the same CPU cores, so time the learner no longer waits is time the workers take from its step; "
              "the speed-up needs devices of the sampler's own (`rollout.sampler_devices`).", ""]
    claims.append(claim("Asynchronous rollouts raise training throughput" + (" (real model)" if real else ""),
                        "AReaL", sp >= SPEEDUP, f"async/sync learner steps/s = {sp:.2f} (rule: ≥ {SPEEDUP}); "
                        "sampler and learner share 2 CPU cores here"))
  return lines, claims


def async_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  lines = ["## Asynchronous training at staleness bound η (AReaL-style)", "", provenance(doc), ""]
  if not doc.get("available", False):
    return lines + [f"{doc.get('reason', 'not available')}", ""], []
  runs = [r for r in doc["runs"] if "summary" in r]
  etas = sorted({r["eta"] for r in runs})
  ms = list(doc.get("methods", {}))
  lines += [f"Learner steps per run: {doc.get('steps')}; seeds: {doc.get('seeds')}. Cells: held-out accuracy "
            "(late) / measured max lag / idle fraction of the learner.", "",
            "| method | " + " | ".join(f"η = {e}" for e in etas) + " |", "|---|" + "---|" * len(etas)]
  for m in ms:
    cells = []
    for e in etas:
      rs = [r for r in runs if r["method"] == m and r["eta"] == e]
      idle = stats([r["summary"]["time_learner_idle_s"] / r["summary"]["time_step_s"] for r in rs
                    if r["summary"].get("time_learner_idle_s") is not None and r["summary"].get("time_step_s")])
      cells.append(f"{fmt(cell(rs))} / {fmt(stats([r['summary']['lag_max'] for r in rs]), 0)} / {fmt(idle, 2)}")
    lines.append(f"| {m} | " + " | ".join(cells) + " |")
  claims = []
  errors = [r for r in doc["runs"] if "error" in r]
  if errors:
    lines += ["", f"{len(errors)} run(s) rejected: {errors[0]['error']}"]
  if etas and runs:
    over = [r for r in runs if r["summary"]["lag_max"] is not None and r["summary"]["lag_max"] > r["eta"]]
    claims.append(claim("Admission keeps every consumed lag ≤ η", "AReaL; DESIGN §3", not over,
                        f"{len(over)} of {len(runs)} runs saw lag_max > η"))
    e0, ek = min(etas), max(etas)
    a0 = cell([r for r in runs if r["method"] == "decoupled_ppo" and r["eta"] == e0])
    ak = cell([r for r in runs if r["method"] == "decoupled_ppo" and r["eta"] == ek])
    if a0 and ak and ek > e0:
      claims.append(claim(f"Decoupled PPO keeps its accuracy under async staleness η={ek}", "AReaL (decoupled PPO)",
                          not drops(a0, ak), f"decoupled_ppo {fmt(a0)} (η={e0}) vs {fmt(ak)} (η={ek})"
                          + seeds_note(a0, ak)))
  lines.append("")
  return lines, claims


def plot_replay(runs, arms, path):
  """Held-out accuracy of each arm (seed 0) against learner steps, generated groups and training time."""
  plt = _plt()
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
  xs = (("steps_done", "learner steps"), ("generated_groups", "generated groups (sampler work)"),
        ("time_train_s", "training time (s)"))
  for a in arms:
    rs = sorted((r for r in runs if r["arm"] == a), key=lambda r: r["seed"])
    if not rs:
      continue
    c = rs[0]["costs"]["curve"]
    for ax, (k, label) in zip(axes, xs):
      ax.plot(c[k], c["eval_accuracy"], marker="o", label=a)
      ax.set_xlabel(label)
  axes[0].set_ylabel("held-out accuracy")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def arm_stats(runs, arm: str, f) -> dict | None:
  """Stats of `f(run)` over the runs of `arm` (None values skipped)."""
  return stats([f(r) for r in runs if r["arm"] == arm])


def replay_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  runs = [r for r in doc["runs"] if "costs" in r]
  base = doc.get("baseline", "no_replay")
  arms = [a for a in doc["arms"] if any(r["arm"] == a for r in runs)]
  lines = ["## Experience replay (B7)", "", provenance(doc), "",
           f"Learner steps per run: {doc.get('steps')} (the same for every arm); seeds: {doc.get('seeds')}; loss: "
           f"`{json.dumps(doc.get('method'))}`; shared overrides: `{json.dumps(doc.get('base_overrides'))}`; arms: "
           f"`{json.dumps(doc.get('arms'))}`. Every arm of a (task, seed) starts from the same SFT warm start in "
           "`sync` mode; a replay arm generates `fresh_per_step` groups per learner step and samples the batch from "
           "the FIFO. Replay ratio = consumed / generated groups; lag = learner version − generating version of a "
           "consumed group; uses = times a consumed group has been sampled (including this one). Training time = "
           "sum of per-step wall time with the first step (compilation) and the evaluation steps counted as the "
           "run's median step. \"at N groups\" / \"at T s\": the run's eval curve (warm start = point 0) "
           "interpolated linearly at the cheapest arm's total generated groups / training time (mean over seeds)."]
  if any(m.get("rollout.old_logp", "recompute") == "recompute" for m in doc.get("method", {}).values()):
    lines[-1] += (" Under `old_logp=recompute` a replay arm scores π_old once per group, when it is generated "
                  "(one forward of the fresh groups per step, cached with the group); a sync run without replay "
                  "skips it (π_old is then the current parameters).")
  lines.append("")
  errors = [r for r in doc["runs"] if "error" in r]
  if errors:
    lines += [f"{len(errors)} run(s) rejected: {errors[0]['error']}", ""]
  claims = []
  for task in sorted({r["task"] for r in runs}):
    tr = [r for r in runs if r["task"] == task]
    tarms = [a for a in arms if any(r["arm"] == a for r in tr)]
    of = functools.partial(arm_stats, tr)
    budget = {r["seed"]: r["at_budget"] for r in tr if "at_budget" in r}  # one budget per (task, seed)
    budget_g = stats([b["generated_groups"] for b in budget.values()])
    budget_t = stats([b["time_train_s"] for b in budget.values()])
    init = stats(list({r["seed"]: r["summary"]["eval_accuracy_initial"] for r in tr}.values()))
    lines += [f"### {task}", "", f"Accuracy after the SFT warm start (before RL): {fmt(init)}.", "",
              "| arm | replay ratio | generated groups | mean lag | mean uses | sampler s/step | s/step | "
              f"acc final | acc best | acc late | acc at {fmt(budget_g, 0)} groups | acc at {fmt(budget_t, 1)} s |",
              "|---|" + "---|" * 11]
    for a in tarms:
      lines.append(" | ".join([
          f"| {a}", fmt(of(a, lambda r: r["costs"]["replay_ratio"]), 2),
          fmt(of(a, lambda r: r["costs"]["generated_groups"]), 0), fmt(of(a, lambda r: r["summary"]["lag_mean"]), 2),
          fmt(of(a, lambda r: r["costs"]["mean_uses"]), 2), fmt(of(a, lambda r: r["costs"]["time_generate_step_s"]), 4),
          fmt(of(a, lambda r: r["costs"]["time_step_s"]), 4), fmt(cell(tr, "eval_accuracy_final", arm=a)),
          fmt(cell(tr, "eval_accuracy_best", arm=a)), fmt(cell(tr, arm=a)),
          fmt(of(a, lambda r: r.get("at_budget", {}).get("eval_accuracy_at_groups"))),
          fmt(of(a, lambda r: r.get("at_budget", {}).get("eval_accuracy_at_time")))]) + " |")
    steps_done = tr[0]["costs"]["curve"]["steps_done"]
    lines += ["", "Held-out accuracy along training (columns: learner steps done):", "",
              "| arm | " + " | ".join(str(s) for s in steps_done) + " |", "|---|" + "---|" * len(steps_done)]
    for a in tarms:
      lines.append(f"| {a} | " + " | ".join(
          fmt(of(a, lambda r, i=i: (r["costs"]["curve"]["eval_accuracy"] + [None] * len(steps_done))[i]))
          for i in range(len(steps_done))) + " |")
    fname = f"replay_{task}.png"
    plot_replay(tr, tarms, os.path.join(fig_dir, fname))
    lines += ["", f"![replay]({rel}/{fname})", ""]
    claims += replay_claims(tr, task, base, tarms)
  return lines, claims


def replay_claims(tr, task, base, arms) -> list[dict]:
  src = "Arnal et al. 2026 (arXiv 2604.08706), spec B7 [2nd-hand]"
  others = [a for a in arms if a != base]
  b_acc = cell(tr, arm=base)
  if b_acc is None or not others:
    return []
  of = functools.partial(arm_stats, tr)
  groups = {a: of(a, lambda r: r["costs"]["generated_groups"]) for a in arms}
  at_g = {a: of(a, lambda r: r.get("at_budget", {}).get("eval_accuracy_at_groups")) for a in arms}
  at_t = {a: of(a, lambda r: r.get("at_budget", {}).get("eval_accuracy_at_time")) for a in arms}
  acc = {a: cell(tr, arm=a) for a in arms}
  note = seeds_note(*acc.values())
  cheap = [a for a in others if groups[a]["mean"] <= (1 - REPLAY_SAVING) * groups[base]["mean"]]
  same = [a for a in cheap if acc[a] is not None and not drops(b_acc, acc[a])]
  out = [claim(
      f"Replay reaches no-replay accuracy with ≥ {REPLAY_SAVING:.0%} fewer generated groups ({task})", src,
      bool(same), f"{base}: {fmt(b_acc)} with {fmt(groups[base], 0)} groups; " + "; ".join(
          f"{a}: {fmt(acc[a])} with {fmt(groups[a], 0)} ({groups[a]['mean'] / groups[base]['mean']:.2f}×)"
          for a in others) + f" (rule: some replay arm within {MARGIN} of {base} with ≤ "
      f"{1 - REPLAY_SAVING:.2f}× its groups)" + note)]
  budget = {r["seed"]: r["at_budget"] for r in tr if "at_budget" in r}
  for what, at, amount in (
      ("generated group, at equal sampler work", at_g,
       f"{fmt(stats([b['generated_groups'] for b in budget.values()]), 0)} generated groups"),
      ("second of training, at equal wall time", at_t,
       f"{fmt(stats([b['time_train_s'] for b in budget.values()]), 1)} s of training")):
    helps = [a for a in others if drops(at[a], at[base])]
    out.append(claim(
        f"Replay helps per {what} ({task})", src, bool(helps) if at[base] is not None else None,
        f"accuracy at {amount} (the cheapest arm's total): " + "; ".join(f"{a} {fmt(at[a])}" for a in arms)
        + f" (rule: some replay arm above {base} by > {MARGIN})" + note))
  lower = [a for a in others if acc[a] is not None and acc[a]["mean"] < b_acc["mean"]]
  out.append(claim(
      f"Replay hurts per-learner-step progress ({task})", src, len(lower) == len(others),
      "late accuracy at equal learner steps: " + "; ".join(f"{a} {fmt(acc[a])}" for a in arms)
      + f" (rule: every replay arm below {base})" + note))
  return out


def mismatch_real_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  v = doc["variants"]
  b = doc["bands"]
  lines = [f"## Train/inference mismatch on the real model: {doc.get('model')}", "", provenance(doc), "",
           f"{doc['prompts']} held-out chat prompts × {doc['group']} completions, up to {doc['max_new_tokens']} new "
           f"tokens at temperature {doc['temperature']}, each sampled token rescored by the fp32 learner at the same "
           "parameters: Δ = log π_old − log μ. Bands are the corrections' defaults: IcePop keeps k = π_old/μ in "
           f"[{b['icepop'][0]}, {b['icepop'][1]}], MIS keeps [{b['mis'][0]}, {b['mis'][1]}], TIS caps at "
           f"{b['tis_cap']}. float32 is the control (cached decode vs full forward).", "",
           "| sampler | tokens | mean \|Δ\| | median | p99 | max | mean \|Σ Δ\| per sequence | "
           "outside IcePop band | outside MIS band | above TIS cap |", "|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in v.items():
    lines.append(f"| {name} | {r['tokens']} | {r['abs_mean']:.2e} | {r['abs_median']:.2e} | {r['abs_p99']:.2e} | "
                 f"{r['abs_max']:.2e} | {r['seq_abs_sum_mean']:.2e} | {r['icepop_out_frac']:.4f} | "
                 f"{r['mis_out_frac']:.4f} | {r['tis_capped_frac']:.4f} |")
  claims = []
  if "bfloat16" in v and "float32" in v:
    bf, f32 = v["bfloat16"], v["float32"]
    claims.append(claim("A bf16 sampler's log-probs differ measurably from the fp32 learner's on a real model",
                        "TIS / MIS / IcePop; methods-rl §9.1", bf["abs_mean"] > 10 * f32["abs_mean"],
                        f"mean |Δ| bf16 {bf['abs_mean']:.2e} vs fp32 control {f32['abs_mean']:.2e} (rule: > 10×); "
                        f"tokens outside the IcePop band {bf['icepop_out_frac']:.4f}, outside MIS's "
                        f"{bf['mis_out_frac']:.4f}"))
  lines.append("")
  return lines, claims


def sparse_sync_real_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  lines = [f"## Sparse weight sync on a real RL run: {doc.get('model')}", "", provenance(doc), "",
           f"GRPO with a bf16 sampler and `rollout.weight_sync=sparse`, {doc['steps']} learner steps per learning "
           "rate. Changed = fraction of bf16 sampler weights that differ bitwise from the previous publish; payload = "
           "bytes shipped / dense bf16 bytes, of the publish after each update (the initial publish of version 0 is "
           "dense and has no row); means over steps.", "",
           "| lr | changed fraction | payload ratio | per-step changed fractions |", "|---|---|---|---|"]
  claims = []
  for r in doc["runs"]:
    ok = [s for s in r["steps"] if s.get("changed_frac") is not None]
    per = ", ".join(f"{s['changed_frac']:.3f}" for s in ok)
    cf = sum(s["changed_frac"] for s in ok) / len(ok) if ok else None
    pr = sum(s["payload_ratio"] for s in ok) / len(ok) if ok else None
    lines.append(f"| {r['lr']:g} | {cf:.4f} | {pr:.4f} | {per} |" if cf is not None else f"| {r['lr']:g} | — | — | |")
    if cf is not None:
      claims.append(claim(f"Most bf16 weights are unchanged per step (lr {r['lr']:g}, real model)",
                          "SparseRL-Sync", cf < 0.5, f"changed fraction {cf:.4f}, payload {pr:.4f} of dense "
                          "(rule: changed < 0.5)"))
      claims.append(claim(f"≈99 % of bf16 weights are unchanged per step, the paper's headline (lr {r['lr']:g}, "
                          "real model)", "SparseRL-Sync (spec B6)", cf <= HEADLINE_CHANGED,
                          f"changed fraction {cf:.4f}, payload {pr:.4f} of dense (rule: changed ≤ "
                          f"{HEADLINE_CHANGED}); at 135M parameters and {doc['steps']} steps"))
  lines.append("")
  return lines, claims


KL_REV = "kl_rev_heldout_late"


def opd_real_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """AsyncOPD's claims on the real model: by arm and lag, the late held-out KL(student ‖ teacher) (lower is
  better) and accuracy. The rules: reverse KL "degrades" when its KL at the largest lag `grows` from lag 0;
  forward KL / the recomputed advantage "stay robust" when theirs rises by at most KL_GROWTH (`stays_within`:
  a rise past it inside 2 se is undecided); with no degradation of the
  reverse KL to fix, those two are not testable. Claims name the teacher/student pair (`opd_staleness.REAL_PAIRS`;
  a file without one predates `--pair` and holds the truncated pair)."""
  del fig_dir, rel
  where = f"real model, {doc.get('short', '8-layer student')}"
  runs = [r for r in doc["runs"] if "summary" in r]
  lags = sorted({r["lag"] for r in runs})
  arms = [a for a in doc.get("arms", {}) if any(r["arm"] == a for r in runs)]
  teacher = doc.get("teacher")
  lines = [f"## On-policy distillation under staleness on the real model: {doc.get('model')}", "", provenance(doc), "",
           *([f"Teacher: {teacher['recipe']}; its held-out accuracy {teacher['eval_accuracy']['start']:.3f} before "
              f"RL, {teacher['eval_accuracy']['end']:.3f} after.", ""] if teacher else []),
           f"Learner steps per run: {doc.get('steps')}; rollouts from `fixed_lag`. KL = held-out KL(student ‖ teacher), "
           "exact over the vocabulary on fresh student samples of the held-out prompts (mean of the last 3 "
           "evaluations; lower is better); acc = held-out greedy accuracy.", ""]
  if not runs:
    return lines + ["No finished cells yet.", ""], []
  lines += ["| arm | " + " | ".join(f"KL lag {k}" for k in lags) + " | " + " | ".join(f"acc lag {k}" for k in lags) + " |",
            "|---|" + "---|" * (2 * len(lags))]
  for a in arms:
    lines.append(f"| {a} | " + " | ".join(fmt(cell(runs, KL_REV, arm=a, lag=k)) for k in lags) + " | "
                 + " | ".join(fmt(cell(runs, arm=a, lag=k)) for k in lags) + " |")
  s0 = runs[0]["summary"]
  lines += ["", f"Student before distillation: KL {s0.get('kl_rev_heldout_initial', float('nan')):.3f}, accuracy "
            f"{s0.get('eval_accuracy_initial', float('nan')):.3f}.", ""]
  lines += missing_cells(doc, ("arm", "lag"), lambda a, k: f"{a} lag {k}")
  if len(lags) < 2:
    return lines, []
  k0, k = lags[0], lags[-1]
  kl = lambda a, lag: cell(runs, KL_REV, arm=a, lag=lag)
  # Precondition (a table where nothing learns decides nothing): on-policy reverse-KL OPD lowers the KL.
  init = cell(runs, "kl_rev_heldout_initial", arm="reverse_kl", lag=k0)
  learns = grows(kl("reverse_kl", k0), init)
  claims = [claim(f"On-policy distillation lowers the held-out KL to the teacher ({where}, lag {k0}; precondition)",
                  "this library", learns, f"reverse_kl KL {fmt(init)} before → {fmt(kl('reverse_kl', k0))} late "
                  f"(rule: the initial KL exceeds the late one by > {KL_GROWTH:.0%} and 2 se)")]
  rkl = grows(kl("reverse_kl", k0), kl("reverse_kl", k))
  ev = lambda a: f"{a} KL {fmt(kl(a, k0))} (lag {k0}) → {fmt(kl(a, k))} (lag {k})"
  rule = f" (rule: grows = rises by > {KL_GROWTH:.0%} and 2 se)"
  why0 = "" if learns else "; not testable here: on-policy distillation did not lower the KL (precondition)"
  claims.append(claim(f"Stale rollouts degrade sampled-token reverse-KL OPD ({where}, lag {k})", "AsyncOPD",
                      rkl if learns else None, ev("reverse_kl") + rule + why0))
  for a, text in (("forward_kl", "Forward-KL OPD stays robust where reverse KL degrades"),
                  ("reverse_kl_recompute", "Recomputing the reverse-KL advantage removes the degradation")):
    if a not in arms:
      continue
    kl0 = kl(a, k0)
    verdict = None if not (learns and rkl) or kl0 is None else \
        stays_within(kl0, kl(a, k), KL_GROWTH * abs(kl0["mean"]))
    why = why0 or ("" if rkl else "; reverse KL does not degrade here, so robustness cannot be told apart")
    if verdict == UNDECIDED:
      why += f"; undecided: {a}'s KL rises by more than {KL_GROWTH:.0%} but within 2 se"
    claims.append(claim(f"{text} ({where}, lag {k})", "AsyncOPD", verdict, ev(a) + "; " + ev("reverse_kl") + why))
  return lines, claims


SOAK_SLOPE = 0.02  # "memory stays bounded": RSS grows by < 2% of its start per 100 steps over the second half


def soak_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """The soak (experiments/soak.py): a long async run of the tiny config. Bounded when the ParamStore never
  holds more than η + 1 snapshots (+1: a worker may still pin a just-replaced version, as the test allows)
  and RSS over the second half grows by less than SOAK_SLOPE of its start per 100 steps."""
  del fig_dir, rel
  bound, held, slope = doc["snapshot_bound"], doc["max_snapshots_held"], doc["rss_slope_second_half_mb_per_100_steps"]
  lines = ["## Soak: memory and held snapshots over a long async run (tiny config)", "", provenance(doc), "",
           f"`rollout.mode=async`, η = {doc['eta']}, {doc['steps']} learner steps; RSS sampled after every step.", "",
           "| steps | η | RSS start (MB) | RSS end (MB) | RSS max (MB) | RSS slope, second half (MB / 100 steps) "
           "| snapshots held (max) | bound (η + 1) |", "|---|---|---|---|---|---|---|---|",
           f"| {doc['steps']} | {doc['eta']} | {doc['rss_start_mb']:.1f} | {doc['rss_end_mb']:.1f} | "
           f"{doc['rss_max_mb']:.1f} | {slope:.2f} | {held} | {bound} |", ""]
  ok = held <= bound + 1 and slope < SOAK_SLOPE * doc["rss_start_mb"]
  return lines, [claim(f"A long async run holds bounded snapshots and memory ({doc['steps']} steps, η={doc['eta']})",
                       "DESIGN §3 (ParamStore)", ok,
                       f"max snapshots held {held} (bound {bound}, +1 allowed); RSS slope {slope:.2f} MB / 100 "
                       f"steps vs {SOAK_SLOPE:.0%} of {doc['rss_start_mb']:.0f} MB")]


def agent_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """Multi-turn agents (toy), `experiments/agent_staleness.py`: held-out greedy episode success after an SFT warm
  start on scripted demonstrations (the run's initial evaluation: 0 RL steps) and after RL (`ACC`, the mean of
  the last three evaluations), then fixed lag 0 vs the largest lag per method. "RL raises episode success" is
  the lag-0 baseline's per-seed gain (late − SFT only) by more than MARGIN and 2 standard errors (`learns_claim`'s
  rule); the staleness claims are the staleness ablation's (`staleness_claims`)."""
  env = doc.get("env", {})
  task = f"{env.get('name', 'env')}, multi-turn"
  runs = [{"task": task, **r} for r in doc["runs"]]
  ok = [r for r in runs if "summary" in r]
  base = doc.get("baseline", "grpo")
  ms = [m for m in doc.get("methods", {}) if any(r["method"] == m for r in ok)]
  lags = sorted({r["lag"] for r in ok})
  sft, ref = doc.get("sft", {}), doc.get("reference", {})
  lines = ["## Multi-turn agents (toy)", "", provenance(doc), "",
           f"The tiny character model of `configs/{doc.get('base_config', 'agent_sft_tiny')}.py` plays "
           f"`{env.get('name')}` ({json.dumps(env.get('kwargs'))}, at most {env.get('max_turns')} turns; return 1 when "
           f"the secret digit is guessed). Every run first trains {sft.get('steps')} SFT steps on {sft.get('demos')} "
           f"demonstration episodes of the scripted `{sft.get('demo_player')}` player (`jaxrl_llm/envs/demos.py`), "
           f"laid out as the episode runner lays out an episode, then {doc.get('steps')} learner steps under "
           "`rollout.mode=fixed_lag`. Cells: success of greedy episodes on "
           f"{doc.get('eval_episodes')} held-out seeds no training episode uses (`jaxrl_llm/episode_eval.py`), mean "
           f"± standard error over {doc.get('seeds')} seeds; SFT + RL is the mean of a run's last three evaluations "
           f"(every {doc.get('eval_every')} steps), SFT only its evaluation before the first learner step. "
           "Scripted players on the same held-out seeds: "
           + ", ".join(f"{p} {v:.3f}" for p, v in sorted(ref.items())) + ".", ""]
  if not ok:
    return lines + ["No finished runs." + (f" First error: {doc['runs'][0]['error']}" if doc["runs"] else ""), ""], []
  k0 = min(lags)
  b = [r for r in ok if r["method"] == base and r["lag"] == k0]
  sft_only = stats([r["summary"]["eval_accuracy_initial"] for r in b])
  rl = cell(b)
  turns = lambda rs, k: stats([r.get("episodes", {}).get(k) for r in rs])
  lines += [f"| policy ({base}, lag {k0}) | held-out episode success | mean turns per held-out episode (same evaluation; last one after RL) |",
            "|---|---|---|",
            f"| SFT only (0 RL steps) | {fmt(sft_only)} | {fmt(turns(b, 'eval_episode_turns_initial'), 2)} |",
            f"| SFT + RL ({doc.get('steps')} steps) | {fmt(rl)} | {fmt(turns(b, 'eval_episode_turns_final'), 2)} |",
            "", "Fixed lag (`rollout.lag`): held-out episode success after RL.", "",
            "| method | " + " | ".join(f"lag {k}" for k in lags) + " |", "|---|" + "---|" * len(lags)]
  for m in ms:
    lines.append(f"| {m} | " + " | ".join(fmt(cell(ok, method=m, lag=k)) for k in lags) + " |")
  version0 = start_model_batches(doc["steps"], lags) if doc.get("steps") else ""
  same = same_trajectory(ok, base, k0)
  lines += ["", version0] if version0 else []
  if same:
    lines += ["", f"At lag {k0}, {', '.join(same)} ran {base}'s trajectory exactly (identical reward and held-out "
              "curves on every seed): on-policy they make the same update, so those cells carry no information of "
              "their own."]
  errors = [r for r in doc["runs"] if "error" in r]
  if errors:
    lines += ["", f"{len(errors)} run(s) rejected: {errors[0]['error']}"]
  f1 = "agent_guess_number_acc_vs_lag.png"
  plot_acc_vs_lag(ok, task, ms, lags, os.path.join(fig_dir, f1))
  lines += ["", f"![episode success vs lag]({rel}/{f1})", ""]
  g = gain(b)
  raised = None if g is None else g["mean"] > MARGIN and (g["n"] < 2 or g["mean"] > 2 * g["se"])
  claims = [claim(f"RL raises held-out multi-turn episode success after an SFT warm start on demonstrations "
                  f"({task}, {base}, lag {k0})", "issue 33", raised,
                  f"SFT only {fmt(sft_only)} → SFT + RL {fmt(rl)}; per-seed gain {fmt(g)} "
                  f"(rule: > {MARGIN} and 2 se)" + seeds_note(g))]
  return lines, claims + staleness_claims(ok, task, base, lags)


def kv_compression_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """KV-compressed rollouts (issue 34, spec B10), `experiments/kv_compression.py`: the mismatch table of each
  sampler KV cache against the dense learner (start policy, no training) and the window-cache training grid.
  Reward is `reward_mean_last` (the training reward of the last fifth of the steps, sampled with the compressed
  cache). "SMD beats uncorrected" is `exceeds` on that reward (MARGIN and 2 se); "TIS does not mitigate the
  bias" holds when TIS's reward does not exceed uncorrected's (`exceeds` False; UNDECIDED kept)."""
  lines = ["## KV-compressed rollouts (int8 / sinks + window sampler cache)", "", provenance(doc), ""]
  bands = doc.get("bands", {})
  table = doc.get("mismatch", {})
  win = doc.get("caches", {}).get("window", {})
  lines += [f"Start policy: the SFT warm start of `configs/{doc.get('base_config', 'default')}.py` on 2-digit "
            f"addition; {doc.get('prompts')} held-out prompts × {doc.get('group')} samples per cache, every sampled "
            "token rescored by the dense fp32 learner (Δ = log π_old − log μ). Window cache: "
            f"{win.get('sampler.kv_sinks')} sinks + a window of {win.get('sampler.kv_window')} positions. The static "
            "sampler allocates a ring buffer of P + sinks + window slots when sinks + window < N (else the full "
            "cache, which is then no larger); the bytes column is what it allocates, the ring column the bytes of "
            "sinks + window slots (at most P + N), from shapes. Bands at the losses' "
            f"defaults: IcePop {bands.get('icepop')}, MIS {bands.get('mis')}, TIS cap {bands.get('tis_cap')}.", "",
            "| cache | bytes / sequence (cache arrays) | ring buffer bytes / sequence (computed) | keys kept | "
            "mean abs Δ | max abs Δ | outside IcePop | outside MIS | above TIS cap |",
            "|---|---|---|---|---|---|---|---|---|"]
  f = lambda v, d=4: "—" if v is None else f"{v:.{d}f}"
  for name, r in table.items():
    ring = r.get("ring_buffer_bytes_per_seq")
    lines.append(f"| {name} | {r['bytes_per_seq']} | {'—' if ring is None else ring} | {f(r.get('kept_frac'), 3)} | "
                 f"{f(r['abs_mean'], 5)} | {f(r['abs_max'])} | {f(r['icepop_out_frac'])} | {f(r['mis_out_frac'])} | "
                 f"{f(r['tis_capped_frac'])} |")
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  ms = [m for m in doc.get("methods", {}) if any(r["method"] == m for r in ok)]
  lines += ["", f"Training with the window cache: {doc.get('steps')} learner steps, seeds {planned_seeds(doc)}; "
            "`none` = `ppo_clip` with π_old recomputed by the dense learner (blind to μ), `tis` = truncated IS on "
            "π_old/μ, `smd` = PPO on the shadow forward (the sampler's mask) + λ·KL(dense ‖ sg shadow) at the loss's "
            "default λ. Held-out "
            "accuracy is greedy decoding with the same compressed cache.", "",
            "| method | reward (end) | held-out accuracy (late) | initial accuracy | mean abs(log π_old − log μ) |",
            "|---|---|---|---|---|"]
  for m in ms:
    rs = [r for r in ok if r["method"] == m]
    lines.append(f"| {m} | {fmt(cell(rs, 'reward_mean_last'))} | {fmt(cell(rs))} | "
                 f"{fmt(cell(rs, 'eval_accuracy_initial'))} | {fmt(cell(rs, 'mismatch_abs_mean'), 5)} |")
  lines += rejected(doc)
  dead = [r for r in ok if (r["summary"].get("reward_mean_last") or 0.0) < 1e-3
          and (r["summary"].get("eval_accuracy_initial") or 0.0) > 0]
  if dead:
    lines += ["", "Runs whose reward collapsed to 0 (last fifth of the steps) from a start policy that scored: "
              + ", ".join(f"{r['method']} seed {r['seed']} (accuracy {r['summary']['eval_accuracy_initial']:.3f} → "
                          f"{(r['summary'].get(ACC) or 0.0):.3f})" for r in dead) + "."]
  if ms:
    fname = "kv_compression_reward.png"
    plot_bars(ms, {"reward (end)": [(cell([r for r in ok if r["method"] == m], "reward_mean_last") or {}).get("mean")
                                    for m in ms]}, "training reward (last fifth)", "Window KV cache",
              os.path.join(fig_dir, fname))
    lines += ["", f"![kv compression]({rel}/{fname})"]
  lines.append("")
  claims = []
  rew = {m: cell([r for r in ok if r["method"] == m], "reward_mean_last") for m in ms}
  if "none" in rew and "smd" in rew:
    v = exceeds(rew["smd"], rew["none"])
    claims.append(claim("SMD trains better than uncorrected RL under a compressed (sinks + window) sampler KV cache",
                        "SMD, arXiv 2605.06850 (spec B10)", v,
                        f"end reward smd {fmt(rew['smd'])} vs none {fmt(rew['none'])}" + seeds_note(rew["smd"], rew["none"])))
  if "none" in rew and "tis" in rew:
    v = exceeds(rew["tis"], rew["none"])
    claims.append(claim("IS (TIS) does not mitigate the KV-compression bias", "SMD, arXiv 2605.06850 (spec B10)",
                        v if v in (None, UNDECIDED) else not v,
                        f"end reward tis {fmt(rew['tis'])} vs none {fmt(rew['none'])}" + seeds_note(rew["tis"], rew["none"])))
  return lines, claims


def routing_replay_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """MoE routing replay off-policy (`experiments/routing_replay.py`): no replay, R3 and R2 at each lag, held-out
  accuracy (late), end reward and the mean |log π_old − log μ|. Claims by `exceeds` on held-out accuracy (MARGIN
  and 2 se): R3 beats no replay at the largest lag; R2 beats R3 at the smallest lag and R3 beats R2 at the largest
  (Qwen's "R2 at low off-policiness, R3 at high"), paired by seed (every arm of a seed starts from the same SFT).
  Precondition: RL raises accuracy at the smallest lag (the per-seed gain over the initial accuracy past MARGIN
  and 2 se); without it every claim is "not testable here"."""
  lines = ["## MoE routing replay off-policy (none / R3 / R2 / PR2)", "", provenance(doc), ""]
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  lags = doc.get("lags", [])
  arms = [a for a in doc.get("arms", {}) if any(r["arm"] == a for r in ok)]
  lines += [f"The tiny policy with an MoE MLP ({doc.get('base_overrides', {}).get('model.num_experts')} experts, "
            f"top-{doc.get('base_overrides', {}).get('model.experts_per_token')}), sampled in bfloat16 and trained "
            f"in float32 with `ppo_clip` at fixed lag, 2 minibatches per step, {doc.get('steps')} steps, seeds "
            f"{planned_seeds(doc)}. R3 replays the sampler's expert ids, R2 the learner's own at the step start, PR2 the "
            "sampler's, which routed with each router predicted `lag` updates ahead (`jaxrl_llm/route_predictor.py`).", "",
            "| arm | lag | held-out accuracy (late) | initial accuracy | reward (end) | mean abs(log π_old − log μ) |",
            "|---|---|---|---|---|---|"]
  acc = {}
  for lag in lags:
    for a in arms:
      rs = [r for r in ok if r["arm"] == a and r["lag"] == lag]
      acc[a, lag] = cell(rs)
      lines.append(f"| {a} | {lag} | {fmt(acc[a, lag])} | {fmt(cell(rs, 'eval_accuracy_initial'))} | "
                   f"{fmt(cell(rs, 'reward_mean_last'))} | {fmt(cell(rs, 'mismatch_abs_mean'), 5)} |")
  lines += rejected(doc)
  lines.append("")
  claims = []
  if not lags:
    return lines, claims
  lo, hi = min(lags), max(lags)
  base = next((a for a in ("none", "R3", "R2") if (a, lo) in acc), None)
  b0 = [r for r in ok if r["arm"] == base and r["lag"] == lo]
  start = cell(b0, "eval_accuracy_initial")
  learns = exceeds_paired(gain(b0))
  if learns is not True:  # the comparisons mean nothing when RL does not move the policy at all
    lines += [f"RL did not raise held-out accuracy at lag {lo} ({base}: {fmt(start)} → {fmt(acc.get((base, lo)))}), "
              "so the replay comparisons are not testable at this scale: a larger MoE or longer runs would decide "
              "them.", ""]
  pairs = [(("R3", hi), ("none", hi), "Routing replay (R3) is needed for MoE RL off-policy: it beats no replay at "
            f"lag {hi}", "R3, arXiv 2510.11370 (methods-rl §8)"),
           (("R2", lo), ("R3", lo), f"R2 beats R3 at low off-policiness (lag {lo})", "Qwen routing replay study "
            "(methods-rl §8)"),
           (("R3", hi), ("R2", hi), f"R3 beats R2 at high off-policiness (lag {hi})", "Qwen routing replay study "
            "(methods-rl §8)")]
  pairs.append((("PR2", hi), ("R3", hi), f"Predictive routing replay (PR2) beats R3 off-policy (lag {hi})",
                "PR2, arXiv 2606.00395 (methods-rl §8)"))
  for a, b, text, source in pairs:
    if a in acc and b in acc:
      lag_runs = [r for r in ok if r["lag"] == a[1]]
      d = paired(lag_runs, "arm", a[0], b[0])
      evidence = (f"held-out accuracy {a[0]} {fmt(acc[a])} vs {b[0]} {fmt(acc[b])}; per-seed difference {fmt(d)} "
                  f"(rule, paired by seed: higher by > {MARGIN} and 2 se)" + seeds_note(acc[a], acc[b]))
      if learns is not True:
        evidence += f"; not testable: RL did not raise accuracy at lag {lo} ({fmt(start)} → {fmt(acc[base, lo])})"
      claims.append(claim(text, source, exceeds_paired(d) if learns is True else None, evidence))
  if ("PR2", hi) in acc and ("R3", hi) in acc:  # PR2's mechanism: μ closer to the policy that trains on it
    lag_runs = [r for r in ok if r["lag"] == hi]
    d = paired(lag_runs, "arm", "R3", "PR2", "kl_mu_k3_mean")
    k = {a: cell([r for r in lag_runs if r["arm"] == a], "kl_mu_k3_mean") for a in ("PR2", "R3")}
    lower = None if d is None else exceeds_paired(d, PR2_KL_MARGIN * abs(k["R3"]["mean"]))
    claims.append(claim(f"PR2 brings the sampler's μ closer to the learner's π_θ than R3 (lag {hi})",
                        "PR2, arXiv 2606.00395 (methods-rl §8)", lower,
                        f"mean KL(μ ‖ π_θ) (k3) PR2 {fmt(k['PR2'], 5)} vs R3 {fmt(k['R3'], 5)}; per-seed R3 − PR2 "
                        f"{fmt(d, 5)} (rule: lower by > {PR2_KL_MARGIN:.0%} of R3's and 2 se)"))
  return lines, claims


def mu_grpo_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """μ-GRPO (`experiments/mu_grpo.py`): synchronous GRPO against the `mu_grpo` loss in a few large stages.
  "Matches GRPO's accuracy": GRPO's held-out accuracy does not exceed μ-GRPO's by more than MARGIN, on the per-seed
  differences (both arms of a seed start from its warm start; `within_paired`, UNDECIDED kept); "faster in
  wall-clock": μ-GRPO's learner steps/s ≥ SPEEDUP × GRPO's."""
  lines = ["## μ-GRPO: a few large stages against synchronous GRPO", "", provenance(doc), ""]
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  arms = doc.get("arms", {})
  lag = arms.get("mu_grpo", {}).get("rollout.lag")
  lines += [f"`grpo` = `ppo_clip` in sync mode; `mu_grpo` = the `mu_grpo` loss in `staged` mode, {doc.get('stages')} "
            f"stages of {lag} learner steps each generated at once by the version at the stage start; "
            f"{doc.get('steps')} steps, seeds {planned_seeds(doc)}, the SFT warm start of "
            f"`configs/{doc.get('base_config', 'default')}.py` on 2-digit addition. Seconds per learner step leave "
            "out the first (compilation) and include each stage's generation.", "",
            "| arm | held-out accuracy (late) | initial accuracy | reward (end) | s per learner step |",
            "|---|---|---|---|---|"]
  acc, step = {}, {}
  for a in arms:
    rs = [r for r in ok if r["arm"] == a]
    if not rs:
      continue
    acc[a], step[a] = cell(rs), cell(rs, "time_step_s")
    lines.append(f"| {a} | {fmt(acc[a])} | {fmt(cell(rs, 'eval_accuracy_initial'))} | "
                 f"{fmt(cell(rs, 'reward_mean_last'))} | {fmt(step[a])} |")
  lines += rejected(doc)
  lines.append("")
  claims = []
  if "grpo" in acc and "mu_grpo" in acc:
    d = paired(ok, "arm", "mu_grpo", "grpo")
    claims.append(claim("μ-GRPO in a few large stages matches synchronous GRPO's accuracy", "μ-GRPO (arXiv 2605.17570)",
                        within_paired(d), f"held-out accuracy mu_grpo {fmt(acc['mu_grpo'])} vs grpo {fmt(acc['grpo'])}"
                        f"; per-seed difference {fmt(d)} (rule, paired by seed: grpo not above by > {MARGIN})"
                        + seeds_note(acc["mu_grpo"], acc["grpo"])))
    sp = step["grpo"]["mean"] / step["mu_grpo"]["mean"]
    claims.append(claim("μ-GRPO's staged schedule trains faster in wall-clock than synchronous GRPO",
                        "μ-GRPO (arXiv 2605.17570)", sp >= SPEEDUP,
                        f"mu_grpo/grpo learner steps/s = {sp:.2f} (rule: ≥ {SPEEDUP}); 2 shared CPU cores"))
  return lines, claims


def cell_claims(doc, runs=None) -> list[dict]:
  """Per claim (text, source, a, b, rule[, options]) of `doc["claims"]`, its verdict on the per-seed differences of
  options["metric"] (default held-out accuracy; every cell of a seed starts from its warm start): `exceeds_paired`
  ("beats", "degrades"), `within_paired` ("as good as": b not above a by more than the margin) or "below" (a lower
  than b: `exceeds_paired` of b − a), or "learns" (a's held-out accuracy rises over its initial one; b unused), UNDECIDED
  kept. options["margin"] replaces MARGIN; options["requires"] = (c, d) makes a claim that holds testable only where c
  beats d (a stability claim needs the baseline to degrade); options["learns"] = c makes any verdict testable only
  where cell c learns (comparing methods that move nothing says nothing), unless a falls below b past the margin and
  2 se (a method that hurts is answered)."""
  ok = [r for r in (doc.get("runs", []) if runs is None else runs) if "summary" in r]
  gain_of = lambda c: gain([r for r in ok if r["cell"] == c])
  out = []
  for text, source, a, b, rule, *opt in doc.get("claims", []):
    opt = opt[0] if opt else {}
    if rule == "learns":
      g = gain_of(a)
      if g is not None:
        out.append(claim(text, source, exceeds_paired(g), f"{a}: held-out accuracy late − initial per seed {fmt(g)} "
                         f"(rule: > {MARGIN} and 2 se)"))
      continue
    metric, margin = opt.get("metric", ACC), opt.get("margin", MARGIN)
    sa, sb = cell([r for r in ok if r["cell"] == a], metric), cell([r for r in ok if r["cell"] == b], metric)
    if sa is None or sb is None:
      continue
    d = paired(ok, "cell", a, b, metric)
    if rule == "below":
      v = exceeds_paired(flip(d), margin)
    else:
      v = exceeds_paired(d, margin) if rule == "exceeds" else within_paired(d, margin)
    how = {"exceeds": "higher by > {m} and 2 se", "below": "lower by > {m} and 2 se",
           "within": f"{b} not above by > {{m}}"}[rule].format(m=margin)
    name = "held-out accuracy" if metric == ACC else f"`{metric}`"
    evidence = (f"{name} {a} {fmt(sa)} vs {b} {fmt(sb)}; per-seed difference {fmt(d)} (rule, paired by seed: "
                f"{how})" + seeds_note(sa, sb))
    if "requires" in opt and v is True:  # a method that fell below is unstable whatever the baseline did
      c, e = opt["requires"]
      if exceeds_paired(paired(ok, "cell", c, e)) is not True:
        v, evidence = None, evidence + f"; not testable here: {c} does not beat {e} (the claim's premise)"
    # A falls below b past the margin and 2 se: a hurts, whatever the baseline learnt; anything else needs it to.
    falls = exceeds_paired(flip(d), margin) is True
    if "learns" in opt and not falls and exceeds_paired(gain_of(opt["learns"])) is not True:
      v, evidence = None, evidence + f"; not testable here: {opt['learns']} does not raise held-out accuracy"
    out.append(claim(text, source, v, evidence))
  return out


def cell_claims_section(doc, fig_dir, rel, title: str = "", what: str = "") -> tuple[list[str], list[dict]]:
  """A cell grid's claims (`method_claims`, `headline_staleness`, `opd_claims`): a table of every cell's held-out
  accuracy, then `cell_claims`."""
  lines = [f"## {title}", "", provenance(doc), ""]
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  what = what.format(base=doc.get("base_config", "default"))
  lines += [f"{doc.get('steps')} steps, seeds {planned_seeds(doc)}, {what}", "",
            "| cell | overrides | held-out accuracy (late) | initial accuracy | reward (end) | k3 KL to μ (mean) | "
            "clipped or masked |", "|---|---|---|---|---|---|---|"]
  for c, over in doc.get("cells", {}).items():
    rs = [r for r in ok if r["cell"] == c]
    shown = ", ".join(f"`{k}={v}`" for k, v in over.items())
    trust = stats([trust_frac(r["summary"]) for r in rs])
    lines.append(f"| {c} | {shown} | {fmt(cell(rs))} | {fmt(cell(rs, 'eval_accuracy_initial'))} | "
                 f"{fmt(cell(rs, 'reward_mean_last'))} | {fmt(cell(rs, 'kl_mu_k3_mean'))} | {fmt(trust)} |")
  lines += rejected(doc)
  lines.append("")
  return lines, cell_claims(doc, ok)


method_claims_section = functools.partial(
    cell_claims_section, title="Single-comparison method claims (SAT, Delightful PG, ALP)",
    what="from the SFT warm start of `configs/{base}.py` on 2-digit addition.")
headline_staleness_section = functools.partial(
    cell_claims_section, title="VESPO and M2PO at their headline staleness (lag 64, 256 stale updates)",
    what="from the SFT warm start of `configs/{base}.py` on 2-digit addition, `rollout.mode=fixed_lag` (the batch "
         "of step t from version max(0, t − lag)).")

MC_UNBIASED = 2.0  # "unbiased": the squared bias of the mean gradient is within 2x its expected noise, var / draws

agent_claims_section = functools.partial(
    cell_claims_section, title="Multi-turn method claims (EPO)",
    what="each run from its seed's SFT warm start of `configs/{base}.py` (guess-the-number; the held-out "
         "accuracy is greedy episode success on unseen seeds), lag 0.")


# The scaffolds' own metrics (`experiments.common.metric_thirds`): (cell, metric, what it is)
SCAFFOLD_METRICS = [
    ("echo", "echo_reward_initial", "ECHO: reward of the attempts (bare prompts: the policy itself)"),
    ("echo", "echo_reward_refined", "ECHO: reward of the refinements"),
    ("echo", "echo_gain", "ECHO: refinement − attempt reward"),
    ("echo", "echo_improved_frac", "ECHO: share of refinements above their attempt"),
    ("pats", "pats_cards", "Pats: cards held"),
    ("pats", "pats_carded_frac", "Pats: share of rows shown a card"),
    ("pats", "pats_reward_carded", "Pats: reward of carded rows (groups with a card)"),
    ("pats", "pats_reward_bare", "Pats: reward of bare rows (same groups)"),
]


def scaffold_claims_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """`experiments/scaffold_claims.py`: the cell grid's claims (`cell_claims_section`), then each mechanism's own
  metrics over the first and the last third of its runs (seeds' means ± se): whether ECHO's refinements come to
  beat their attempts while the policy itself moves, and whether Pats' cards help the rows that see them."""
  lines, claims = cell_claims_section(
      doc, fig_dir, rel, title="Training-time scaffolds (ECHO's co-evolving critic, Pats' evidence cards)",
      what=f"each run from its seed's SFT warm start of `configs/{doc.get('base_config', 'default')}.py` (ECHO and "
           "its GRPO on 2-digit addition with partial credit, Pats and its GRPO on one-digit addition after a 30-step "
           "warm start), lag 0; "
           "the held-out accuracy is greedy, without critique or card.")
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  rows = [(what, cell([r for r in ok if r["cell"] == c], f"{m}_early"), cell([r for r in ok if r["cell"] == c],
           f"{m}_late")) for c, m, what in SCAFFOLD_METRICS]
  rows = [(w, a, b) for w, a, b in rows if a is not None or b is not None]
  if rows:
    lines += ["The mechanisms' own metrics (training rows, mean over the first and the last third of the steps):", "",
              "| metric | first third | last third |", "|---|---|---|"]
    lines += [f"| {w} | {fmt(a)} | {fmt(b)} |" for w, a, b in rows] + [""]
  return lines, claims


def opd_claims_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """`experiments/opd_claims.py`: the cell grid's claims (`cell_claims_section`), then AsyncOPD's variance claim
  from the direct measurement (`mc_variance`): J = 4 candidates reduce the one-sample gradient's variance when
  var_J4 / var_J1 < RATIO_MUCH_SMALLER in every seed, and the estimator stays unbiased when bias · draws / var ≤
  MC_UNBIASED for each J."""
  lines, claims = cell_claims_section(
      doc, fig_dir, rel, title="Distillation claims (S²D-OPD, f-OPD, Open-MOPD, SDCC, AsyncOPD's MC estimator)",
      what="each from its seed's warm start: OPD cells on `configs/opd_default.py` (the default student after 250 "
           "SFT steps, a same-shape teacher after 1500; 2-digit addition), the SDCC cells on `configs/agent_sft_tiny.py` "
           f"with `configs/sdcc_tiny.py`'s eviction ({doc.get('agent_steps')} steps, guess-the-number, SFT warm "
           "start, the oldest turns evicted).")
  mc = doc.get("mc_variance")
  if not mc or not mc.get("runs"):
    return lines, claims
  rs, draws = mc["runs"], mc["draws"]
  ratio = [r["var_J4"] / r["var_J1"] for r in rs]
  rel = lambda r, key: r[f"bias_{key}"] * draws / r[f"var_{key}"]  # 1 when unbiased
  lines += ["AsyncOPD's Monte-Carlo reverse-KL estimator, measured directly: the gradient of `opd_reverse_kl_mc` "
            "with respect to the student's logits over independent draws of the sampler's candidate records, at "
            f"the states of the held-out batch the warm-started student samples ({draws} draws per J; exact "
            "gradient of KL(π ‖ p) beside it). bias · draws / var is 1 for an unbiased estimator. The last column is "
            "the student's mass on tokens the teacher gives less than e⁻²⁰ of its probability: where an advantage "
            "clamped to ±20 (the loss's until this measurement found it: bias · draws / var up to 8.4) is biased." +
            (f" Measured by `{mc['command']}` at commit `{mc['commit']}`." if mc.get("command") else ""), "",
            "| seed | trace var, J = 1 | trace var, J = 4 | ratio | bias · draws / var, J = 1 | J = 4 "
            "| π-mass past ±20 |", "|---|---|---|---|---|---|---|"]
  for r, q in zip(rs, ratio):
    lines.append(f"| {r['seed']} | {r['var_J1']:.3g} | {r['var_J4']:.3g} | {q:.3f} | {rel(r, 'J1'):.2f} | "
                 f"{rel(r, 'J4'):.2f} | {r.get('clamped_mass', float('nan')):.3f} |")
  lines.append("")
  claims.append(claim("Multi-sample MC (J = 4) reduces the one-sample reverse-KL estimator's variance",
                      "AsyncOPD (arXiv 2606.24143)", all(q < RATIO_MUCH_SMALLER for q in ratio),
                      f"gradient variance ratio J=4 / J=1 {fmt(stats(ratio))} (rule: < {RATIO_MUCH_SMALLER} in "
                      f"every seed; i.i.d. candidates give 1/4)"))
  worst = max(max(rel(r, "J1"), rel(r, "J4")) for r in rs)
  claims.append(claim("The multi-sample MC estimator (`opd_reverse_kl_mc`) is unbiased (MC correctability)",
                      "AsyncOPD (arXiv 2606.24143)", worst <= MC_UNBIASED,
                      f"squared bias of the mean gradient over its expected noise var/draws at most {worst:.2f} (rule: "
                      f"≤ {MC_UNBIASED}; 1 when unbiased); π-mass where a ±20 advantage clamp would bias it "
                      f"{fmt(stats([r.get('clamped_mass') for r in rs]))}"))
  return lines, claims


def respec_drafter_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """ReSpec's drafter distillation (`experiments/respec_drafter.py`): acceptance of a distilled 1-layer drafter
  against the policy's own first layer. "Raises acceptance": the distilled arm's acceptance over the last fifth of
  the steps exceeds the layer view's by MARGIN (an absolute rate here) and 2 se (`exceeds`)."""
  lines = ["## ReSpec: a distilled speculative drafter against the policy's first layer", "", provenance(doc), ""]
  ok = [r for r in doc.get("runs", []) if "summary" in r]
  b = doc.get("base_overrides", {})
  lines += [f"γ = {b.get('sampler.spec_gamma')} drafted tokens per policy call, a {b.get('sampler.spec_draft_layers')}"
            f"-layer drafter, {doc.get('steps')} steps, seeds {planned_seeds(doc)}. Acceptance = drafted tokens the "
            "policy accepted (`spec_accept_rate`), over the first and the last fifth of the steps.", "",
            "| drafter | acceptance (first fifth) | acceptance (last fifth) | held-out accuracy (late) |",
            "|---|---|---|---|"]
  last = {}
  for a in doc.get("arms", {}):
    rs = [r for r in ok if r["arm"] == a]
    if rs:
      last[a] = cell(rs, "accept_last")
      lines.append(f"| {a} | {fmt(cell(rs, 'accept_first'))} | {fmt(last[a])} | {fmt(cell(rs))} |")
  lines.append("")
  claims = []
  if last.get("distilled") is not None and last.get("layers") is not None:
    d = paired(ok, "arm", "distilled", "layers", "accept_last")
    claims.append(claim("Distilling the drafter on rollouts raises speculative acceptance", "ReSpec (spec B9)",
                        exceeds_paired(d),
                        f"acceptance (last fifth) distilled {fmt(last['distilled'])} vs the policy's first layer "
                        f"{fmt(last['layers'])}; per-seed difference {fmt(d)} (rule, paired by seed: higher by > "
                        f"{MARGIN} and 2 se)" + seeds_note(last["distilled"], last["layers"])))
  return lines, claims


A3PO_SAVING = 0.18  # A-3PO's abstract: training time reduced by 18 %


def a3po_time_section(doc, fig_dir, rel) -> tuple[list[str], list[dict]]:
  """A-3PO's time saving (`experiments/a3po_time.py`): seconds per learner step of decoupled PPO (π_prox by a
  forward) and A-3PO (interpolated). Reproduces when the saving 1 − t_a3po / t_decoupled is at least half the
  abstract's 18 % and 2 combined standard errors of the step times (repeats) separate the arms."""
  lines = ["## A-3PO: the proximal forward it removes", "", provenance(doc), ""]
  runs = [r for r in doc.get("runs", []) if "timing" in r]
  b = doc.get("base_overrides", {})
  lines += [f"{b.get('rollout.mode')} lag {b.get('rollout.lag')}, {b.get('rollout.prompts_per_step')} prompts × "
            f"{b.get('rollout.group_size')}, {doc.get('steps')} steps minus the first {doc.get('skip')}, "
            f"{doc.get('repeats')} repeats alternating the arms.", "",
            "| arm | s per learner step | learner steps/s |", "|---|---|---|"]
  st = {}
  for a in doc.get("arms", {}):
    rs = [r for r in runs if r["arm"] == a]
    if rs:
      st[a] = stats([r["timing"]["time_step_s"] for r in rs])
      lines.append(f"| {a} | {fmt(st[a])} | {fmt(stats([r['timing']['steps_per_s'] for r in rs]), 2)} |")
  lines.append("")
  claims = []
  if "a3po" in st and "decoupled_ppo" in st:
    saving = 1 - st["a3po"]["mean"] / st["decoupled_ppo"]["mean"]
    separated = drops(st["decoupled_ppo"], st["a3po"], margin=0.0)
    verdict = saving >= A3PO_SAVING / 2 and bool(separated)
    claims.append(claim("A-3PO cuts training time by removing the proximal forward (abstract: 18 %)",
                        "A-3PO (AReaL prox_approx)", verdict,
                        f"step time a3po {fmt(st['a3po'])} vs decoupled_ppo {fmt(st['decoupled_ppo'])} s: saving "
                        f"{saving:.1%} (rule: ≥ {A3PO_SAVING / 2:.0%} and 2 se); the tiny model's forward is a smaller "
                        "share of a step than an LLM's"))
  return lines, claims


def rejected(doc) -> list[str]:
  """The lines saying how many of a document's runs their config rejected, and the first reason ([] if none)."""
  errors = [r for r in doc.get("runs", []) if "error" in r]
  return ["", f"{len(errors)} run(s) rejected: {errors[0]['error']}"] if errors else []


def claim(text: str, source: str, verdict: bool | str | None, evidence: str) -> dict:
  return {"claim": text, "source": source, "verdict": verdict, "evidence": evidence}


VERDICT = {True: "reproduces", False: "does not reproduce", None: "not testable here",
           UNDECIDED: "undecided at this noise"}

SECTIONS = {"staleness_smollm2": functools.partial(staleness_section, real=True),
            "mismatch_real": mismatch_real_section, "mismatch_smollm2": functools.partial(mismatch_section, real=True),
            "opd_staleness_smollm2_rl": opd_real_section, "opd_staleness_smollm2": opd_real_section,
            "sparse_sync_real": sparse_sync_real_section,
            "staleness_ablation": staleness_section, "mismatch_ablation": mismatch_section,
            "async_throughput": throughput_section,
            "async_throughput_smollm2": functools.partial(throughput_section, real=True), "async_staleness": async_section,
            "replay_ablation": replay_section, "soak": soak_section, "agent_staleness": agent_section,
            "kv_compression": kv_compression_section, "routing_replay": routing_replay_section,
            "mu_grpo": mu_grpo_section, "a3po_time": a3po_time_section,
            "method_claims": method_claims_section, "headline_staleness": headline_staleness_section,
            "opd_claims": opd_claims_section, "agent_claims": agent_claims_section,
            "scaffold_claims": scaffold_claims_section,
            "respec_drafter": respec_drafter_section}


# Other results documents a section reads beside its own (keyword argument -> experiment name).
COMPANIONS = {"mismatch_smollm2": {"start": "mismatch_real"}}

# Sections whose results file is not named after its script.
COMMANDS = {"staleness_smollm2": "python -m experiments.staleness_ablation --real",
            "mismatch_smollm2": "python -m experiments.mismatch_ablation --real",
            "opd_staleness_smollm2_rl": "python -m experiments.opd_staleness --real",
            "opd_staleness_smollm2": "python -m experiments.opd_staleness --real --pair truncated",
            "async_throughput_smollm2": "python -m experiments.async_throughput --real"}


def render(results: dict, fig_dir: str, rel: str) -> str:
  """RESULTS.md text for `results` (experiment name -> results document); writes figures to fig_dir."""
  os.makedirs(fig_dir, exist_ok=True)
  body, claims = [], []
  for name, section in SECTIONS.items():
    if name in results:
      companions = {arg: results.get(other) for arg, other in COMPANIONS.get(name, {}).items()}
      lines, cs = section(results[name], fig_dir, rel, **companions)
      body += lines
      claims += cs
    else:
      body += [f"## {name}", "", f"No results yet: run `{COMMANDS.get(name, 'python -m experiments.' + name)}`.", ""]
  for name in sorted(set(results) - set(SECTIONS)):  # results of scripts that render their own table
    doc = results[name]
    own = ["Table written by the script itself:", "", doc["table_md"].strip()] if doc.get("table_md") else \
        [f"This file has no table of its own (`table_md`); see `experiments/results/{name}.json`."]
    if doc.get("figure"):  # recorded relative to the repository root; linked relative to RESULTS.md's folder
      out_dir = os.path.normpath(os.path.join(fig_dir, os.path.relpath(os.curdir, rel)))
      own += ["", f"![{name}]({os.path.relpath(os.path.join(common.ROOT, doc['figure']), out_dir)})"]
    body += [f"## {name}", "", provenance(doc), "", *own, ""]
  head = ["# Results", "",
          "<!-- Generated by `python -m experiments.report` from experiments/results/*.json. Do not edit. -->", "",
          "Generated from the JSON files in `experiments/results/`; every verdict below is computed by the rules "
          "documented in `experiments/report.py` (margin "
          f"{MARGIN} absolute accuracy; with ≥ 2 seeds also 2 combined standard errors). These are "
          "small-scale runs on a 2-core CPU (the real-model sections use SmolLM2-135M-Instruct for tens of steps; "
          "the others a tiny policy trained for minutes): a claim that does not reproduce here is not refuted at "
          "paper scale.", "",
          "## Seed-paper claims at this scale", "", "| claim | source | verdict | evidence |", "|---|---|---|---|"]
  for c in claims:
    head.append(f"| {c['claim']} | {c['source']} | **{VERDICT[c['verdict']]}** | {c['evidence']} |")
  if not claims:
    head.append("| — | — | — | no results |")
  return "\n".join(head + [""] + body).rstrip() + "\n"


def main(argv=None) -> str:
  import argparse
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--results", default=common.RESULTS_DIR)
  p.add_argument("--out", default=os.path.join(common.ROOT, "docs", "RESULTS.md"))
  p.add_argument("--figures", default=None, help="figure folder (default: figures/ beside --out)")
  args = p.parse_args(argv)
  fig_dir = args.figures or os.path.join(os.path.dirname(os.path.abspath(args.out)), "figures")
  rel = os.path.relpath(fig_dir, os.path.dirname(os.path.abspath(args.out)))
  text = render(load(args.results), fig_dir, rel)
  with open(args.out, "w") as f:
    f.write(text)
  return args.out


if __name__ == "__main__":
  print(main())
