"""Read program order off compiled HLO (`jax.jit(f).lower(...).compile().as_text()`).

XLA runs an instruction only after its operands, and nothing else orders two
instructions, so collectives are in program order exactly when each depends, by
data, on the one before. `order_violations` checks that in every computation:

- the instructions that communicate (vjpmpi custom calls, and while / conditional /
  call instructions whose computations contain one) form one chain of data
  dependencies, so XLA has a single order to run them in;
- a nested computation (loop body, branch, called function) starts its chain from
  what it receives (no fresh token of its own) and returns the end of its chain,
  so the chains inside and outside are joined;
- the whole program creates exactly one fresh token, in the entry computation.

`collective_sequence` lists the collectives in that chain order (loop bodies once).
"""

from __future__ import annotations

import dataclasses
import re

_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(
    r"\b(?:condition|body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="(vjpmpi_\w+)"')
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    operands: list
    called: list
    target: str | None
    root: bool
    literal: str = ""  # the value of a `constant`


def _matching_paren(text, start):
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def parse(text):
    """{computation name: [Instr]} and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.lstrip().startswith("ROOT"):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if current is None or not m:
            continue
        rest = m.group(3)
        op = _OPCODE.search(rest)
        if op is None:
            continue
        close = _matching_paren(rest, op.end() - 1)
        operands = _NAME.findall(rest[op.end():close])
        attrs = rest[close:]
        called = _CALLS.findall(attrs)
        for group in _BRANCHES.findall(attrs):
            called += _NAME.findall(group)
        for group in _CONTROL.findall(attrs):
            operands += _NAME.findall(group)
        target = _TARGET.search(attrs)
        literal = rest[op.end():close].strip() if op.group(1) == "constant" else ""
        comps[current].append(Instr(m.group(2), op.group(1), operands, called,
                                    target.group(1) if target else None, bool(m.group(1)),
                                    literal))
    _prune_constant_conditionals(comps)
    return comps, entry


def _prune_constant_conditionals(comps):
    """A conditional whose branch index is a constant runs that branch only (XLA
    leaves such conditionals behind when it moves the taken branch's work out)."""
    for instrs in comps.values():
        consts = {i.name: i.literal for i in instrs if i.opcode == "constant"}
        for i in instrs:
            if i.opcode != "conditional" or not i.operands or i.operands[0] not in consts:
                continue
            value = consts[i.operands[0]]
            if value in ("true", "false"):
                index = 0 if value == "true" else 1
            else:
                index = int(value)
                if not 0 <= index < len(i.called):
                    index = len(i.called) - 1
            i.called = [i.called[index]]


def _communicating(comps):
    memo = {}

    def comp_has(c):
        if c not in memo:
            memo[c] = False
            memo[c] = any(instr_has(i) for i in comps.get(c, []))
        return memo[c]

    def instr_has(i):
        return i.target is not None or any(comp_has(c) for c in i.called)

    return instr_has


def _ancestors(instrs):
    by_name = {i.name: i for i in instrs}
    memo = {}

    def anc(name):
        if name not in memo:
            memo[name] = set()
            out = set()
            for o in by_name[name].operands if name in by_name else ():
                out.add(o)
                out |= anc(o)
            memo[name] = out
        return memo[name]

    return anc


def _reachable(comps, entry):
    seen, todo = set(), [entry]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo += [sub for i in comps[c] for sub in i.called]
    return seen


def order_violations(text):
    """Everything that leaves the collectives of the compiled program unordered ([] if none)."""
    comps, entry = parse(text)
    comps = {c: comps[c] for c in _reachable(comps, entry)}  # what can run
    has = _communicating(comps)
    problems = []
    fresh = [(c, i.name) for c, instrs in comps.items() for i in instrs
             if i.opcode == "after-all" and not i.operands]
    if any(has(i) for instrs in comps.values() for i in instrs):
        if len(fresh) != 1 or fresh[0][0] != entry:
            problems.append(f"expected one fresh token, in the entry computation; got {fresh}")
    for c, instrs in comps.items():
        chain = [i for i in instrs if has(i)]
        if not chain:
            continue
        anc = _ancestors(instrs)
        # a topological order of the chain: by number of ancestors
        chain.sort(key=lambda i: len(anc(i.name)))
        for a, b in zip(chain, chain[1:]):
            if a.name not in anc(b.name):
                problems.append(f"{c}: {b.name} does not depend on {a.name}")
        if c != entry:
            root = next(i for i in instrs if i.root)
            if root is not chain[-1] and chain[-1].name not in anc(root.name):
                problems.append(f"{c}: the result does not depend on {chain[-1].name}")
    return problems


def collective_sequence(text):
    """The vjpmpi targets in chain order, entering each communicating computation once."""
    comps, entry = parse(text)
    has = _communicating(comps)
    out = []

    def walk(c):
        instrs = comps[c]
        anc = _ancestors(instrs)
        for i in sorted((i for i in instrs if has(i)), key=lambda i: len(anc(i.name))):
            if i.target is not None:
                out.append(i.target[len("vjpmpi_"):])
            for sub in i.called:
                if any(has(j) for j in comps.get(sub, [])):
                    walk(sub)

    walk(entry)
    return out


def assert_ordered(text):
    problems = order_violations(text)
    assert not problems, "collectives not in one chain in the compiled HLO:\n" + "\n".join(
        problems)
