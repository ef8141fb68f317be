"""Generates docs/losses.md from the loss registry: `python -m jaxrl_llm.docs_gen > docs/losses.md`.

The page lists every registered loss with its one-line summary, needs, the config that runs it
(`jaxrl_llm.loss_configs`; or why nothing runs it yet), hyper-parameters (defaults and the comment on
each field) and full docstring. tests/test_docs_losses.py fails when the committed page
is stale, so regenerate after adding or changing a loss.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys

from jaxrl_llm import loss_configs, losses

COMMAND = "python -m jaxrl_llm.docs_gen > docs/losses.md"


def _field_comments(cls) -> dict[str, str]:
  """Trailing `# comment` of each `name: type = default` line in the dataclass source."""
  try:
    src = inspect.getsource(cls)
  except (OSError, TypeError):
    return {}
  out = {}
  for line in src.splitlines():
    m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
    if m:
      out[m.group(1)] = m.group(2).strip()
  return out


def _summary(spec) -> str:
  """First line of the loss file's docstring, or of the function's when a file registers several losses."""
  shared = sum(losses.get(n).fn.__module__ == spec.fn.__module__ for n in losses.names()) > 1
  mod = sys.modules.get(spec.fn.__module__)
  doc = spec.doc if shared else (inspect.getdoc(mod) if mod else "") or spec.doc
  return doc.strip().splitlines()[0] if doc.strip() else ""


def _cell(x: str) -> str:
  return x.replace("|", "\\|")


def render_loss(spec) -> str:
  lines = [f"## `{spec.name}`", "", _summary(spec), ""]
  needs = ", ".join(f"`{n}`" for n in sorted(spec.needs)) or "—"
  cmd = loss_configs.command(spec.name)
  runs = f"`{cmd}`" if cmd else f"not yet: {loss_configs.PENDING.get(spec.name, 'no config provides its inputs')}"
  lines += [f"- needs: {needs}", f"- runs with: {runs}", f"- stateful: {'yes' if spec.init_state else 'no'}",
            f"- defined in: `{spec.fn.__module__}.{spec.fn.__name__}`", ""]
  fields = dataclasses.fields(spec.Hparams)
  if fields:
    comments = _field_comments(spec.Hparams)
    hp = spec.Hparams()
    lines += ["| hyper-parameter | default | note |", "|---|---|---|"]
    for f in fields:
      lines.append(f"| `{f.name}` | `{getattr(hp, f.name)!r}` | {_cell(comments.get(f.name, ''))} |")
    lines.append("")
  else:
    lines += ["No hyper-parameters.", ""]
  lines += ["```text", inspect.cleandoc(spec.doc), "```", ""]
  return "\n".join(lines)


def render() -> str:
  """The whole page, deterministic (sorted by name)."""
  names = losses.names()
  head = [
      "# Policy losses",
      "",
      f"<!-- Generated from the loss registry by `{COMMAND}`. Do not edit by hand. -->",
      "",
      "Every loss is `fn(inputs: LossInputs, hp: Hparams) -> (loss_BN, aux)` and is aggregated once by",
      "`losses.reduce`; `needs` names the optional `LossInputs` fields it reads",
      "(see `jaxrl_llm/losses/registry.py`). `config` is the file that trains it",
      "(`python -m jaxrl_llm --config=configs/<file> --config.loss.name=<loss>`; `jaxrl_llm/loss_configs.py`);",
      "tests/test_every_loss.py trains every loss 2 steps from it.",
      "",
      "| loss | needs | config | summary |",
      "|---|---|---|---|",
  ]
  for n in names:
    spec = losses.get(n)
    needs = ", ".join(sorted(spec.needs)) or "—"
    f = loss_configs.config_for(n)
    head.append(f"| [`{n}`](#{n}) | {needs} | {f'`{f}`' if f else 'not yet'} | {_cell(_summary(spec))} |")
  head.append("")
  return "\n".join(head + [render_loss(losses.get(n)) for n in names]).rstrip("\n") + "\n"


def main() -> None:
  sys.stdout.write(render())


if __name__ == "__main__":
  main()
