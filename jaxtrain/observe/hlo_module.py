"""Compiled HLO text read as computations of instructions: enough structure to follow calls,
loops, conditionals and the values that feed a conditional's branch index (hlo_branches.py)."""
from __future__ import annotations

import dataclasses
import re

_COMMENT = re.compile(r"/\*.*?\*/")  # XLA annotates long tuples with /*index=5*/
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
_DEFINE = re.compile(r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][\w\-]*)\(")
_NAME = re.compile(r"%(?P<name>[\w.\-]+)")
_ATTR_CALLEE = re.compile(r"\b(?P<key>calls|to_apply|condition|body|true_computation|false_computation)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_INDEX = re.compile(r"\bindex=(?P<i>\d+)")


@dataclasses.dataclass
class Instruction:
    name: str
    op: str
    shape: str  # the result's type text, e.g. "s32[6]{0}" or a tuple "(f32[], s32[6]{0})"
    operands: list[str]  # operand names, in order (a constant's literal is in `args`)
    args: str  # the text between the opcode's parentheses
    attrs: str  # everything after them
    line: str  # the whole line, comments removed

    def callee(self, key: str) -> str | None:
        """The computation named by attribute `key` (calls, body, condition, to_apply, ...)."""
        for m in _ATTR_CALLEE.finditer(self.attrs):
            if m.group("key") == key:
                return m.group("name")
        return None

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation) of every computation this instruction calls."""
        out = [(m.group("key"), m.group("name")) for m in _ATTR_CALLEE.finditer(self.attrs)]
        for m in _BRANCHES.finditer(self.attrs):
            out += [("branch", n.strip().lstrip("%")) for n in m.group("names").split(",") if n.strip()]
        return out

    def branches(self) -> list[str]:
        """A conditional's computations in index order (a predicate's: true, then false)."""
        if self.callee("true_computation"):
            return [self.callee("true_computation"), self.callee("false_computation")]
        return [name for key, name in self.callees() if key == "branch"]

    @property
    def trip_count(self) -> int | None:
        m = _TRIP.search(self.attrs)
        return int(m.group("n")) if m else None

    @property
    def tuple_index(self) -> int:
        return int(_INDEX.search(self.attrs).group("i"))


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    root: str | None = None

    def parameter(self, index: int) -> str | None:
        for instr in self.instructions.values():
            if instr.op == "parameter" and instr.args.strip() == str(index):
                return instr.name
        return None


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str | None

    _callers: dict[str, list[tuple[str, Instruction]]] | None = None

    def callers(self, computation: str) -> list[tuple[str, Instruction]]:
        """(computation, instruction) of every instruction that calls `computation`."""
        if self._callers is None:
            self._callers = {}
            for c in self.computations.values():
                for i in c.instructions.values():
                    for _, name in i.callees():
                        self._callers.setdefault(name, []).append((c.name, i))
        return self._callers.get(computation, [])


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def parse_instruction(line: str) -> tuple[Instruction, bool] | None:
    """(instruction, is the computation's root) of one HLO line, or None."""
    line = _COMMENT.sub("", line)
    head = _DEFINE.match(line)
    if head is None:
        return None
    rest = line[head.end():]
    shape_end = _balanced(rest, 0) if rest.startswith("(") else len(rest.split(" ", 1)[0])
    shape, rest = rest[:shape_end], rest[shape_end:]
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    args_end = _balanced(rest, opcode.end() - 1)
    args = rest[opcode.end():args_end - 1]
    operands = [] if opcode.group("op") == "constant" else [m.group("name") for m in _NAME.finditer(args)]
    return Instruction(head.group("name"), opcode.group("op"), shape, operands, args, rest[args_end:], line), bool(head.group("root"))


def parse_module(hlo_text: str) -> Module:
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = Computation(header.group("name"), {})
            computations[current.name] = current
            if header.group("entry"):
                entry = current.name
            continue
        if current is None:
            continue
        parsed = parse_instruction(line)
        if parsed is not None:
            instr, is_root = parsed
            current.instructions[instr.name] = instr
            if is_root:
                current.root = instr.name
    return Module(computations, entry)
