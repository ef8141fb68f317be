"""A tiny safe parser for integer expressions over ``+ - *`` and parentheses (never ``eval``).

Grammar (spaces ignored)::

  expr   := term (("+" | "-") term)*
  term   := factor ("*" factor)*
  factor := NUMBER | "(" expr ")"

NUMBER is 1..MAX_DIGITS ASCII digits (unicode digits are rejected: ``int()`` would accept them).
There is no unary minus, no division and no power. Inputs longer than ``max_len`` or nested
deeper than MAX_DEPTH are rejected before any work, so the cost is bounded for any string.
"""

from __future__ import annotations

MAX_DIGITS = 6
MAX_DEPTH = 32
_DIGITS = frozenset("0123456789")
_OPS = frozenset("+-*()")


def _lex(text: str) -> list[str] | None:
  """Splits into number and operator tokens; None on any other character."""
  tokens, i, n = [], 0, len(text)
  while i < n:
    c = text[i]
    if c == " ":
      i += 1
    elif c in _OPS:
      tokens.append(c)
      i += 1
    elif c in _DIGITS:
      j = i
      while j < n and text[j] in _DIGITS:
        j += 1
      if j - i > MAX_DIGITS:
        return None
      tokens.append(text[i:j])
      i = j
    else:
      return None
  return tokens


def parse_expression(text: str, max_len: int = 256) -> tuple[int, tuple[int, ...]] | None:
  """Parses and evaluates ``text``.

  Returns ``(value, literals)`` with the integer literals in order of appearance, or None when
  ``text`` is not a string, is too long, or is not a well-formed expression. Never raises.
  """
  if not isinstance(text, str) or len(text) > max_len:
    return None
  tokens = _lex(text)
  if not tokens:
    return None
  pos = 0
  literals: list[int] = []

  # Each parser returns the value or None; `pos` advances over consumed tokens.
  def peek():
    return tokens[pos] if pos < len(tokens) else None

  def factor(depth):
    nonlocal pos
    t = peek()
    if t is None or depth > MAX_DEPTH:
      return None
    if t == "(":
      pos += 1
      v = expr(depth + 1)
      if v is None or peek() != ")":
        return None
      pos += 1
      return v
    if t[0] in _DIGITS:
      pos += 1
      literals.append(int(t))
      return int(t)
    return None

  def term(depth):
    nonlocal pos
    v = factor(depth)
    while v is not None and peek() == "*":
      pos += 1
      w = factor(depth)
      v = None if w is None else v * w
    return v

  def expr(depth):
    nonlocal pos
    v = term(depth)
    while v is not None and peek() in ("+", "-"):
      op = tokens[pos]
      pos += 1
      w = term(depth)
      v = None if w is None else (v + w if op == "+" else v - w)
    return v

  value = expr(0)
  if value is None or pos != len(tokens):
    return None
  return value, tuple(literals)
