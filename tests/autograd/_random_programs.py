"""Random programs for the distributed backward, checked against local autograd.

A program is a tree of *specs*: the ops one worker runs on its values, among them RPCs
(and ``remote`` + ``to_here``) whose callee runs a spec of its own, nested up to a
depth. The same program runs twice: distributed (this process is worker0, the calls go
to the workers they name, one distributed backward) and locally (every spec run here,
torch's own autograd). Every leaf's gradient must agree, and afterwards no worker may
hold a context, a running backward or an unreturned gradient loan.

The generator favours what the engine treats specially: gradients of 64 KiB and more
(lent between workers), a call's result passed straight on to the next call (relays),
received tensors used more than once (stops), calls back to the caller and to the
worker itself, several calls at once, tuple results, arguments returned unchanged,
``retain_graph`` followed by a second backward, two roots, and in SMART mode outputs
nothing uses. In FAST mode every received value reaches the callee's outputs (FAST
mode requires every RPC to take part).

Everything a remote call needs (``run_spec`` and the ops) lives in this module, which
the workers import by name: the tests run in-process groups; ``scripts/fuzz_autograd.py``
puts this directory on its worker processes' path.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import math
import operator
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from _ag_helpers import local_copies

import actorgrad as ag

WORKERS = ("worker0", "worker1", "worker2")
UNARY = ("sin", "tanh", "sigmoid", "scale", "addc", "sq", "mul1", "t", "slice", "expand", "view", "clone", "custom")
BINARY = ("add", "mul", "sub", "tmul", "matmul", "pair")
# (160, 128) and (128, 160) float32 are 80 KiB: above the loan threshold
SHAPES = ((160, 128), (160, 128), (128, 128), (128,), (8, 8), (128, 160))
RELAY_CHANCE = 0.55  # a call's arguments are the previous call's results


@dataclass(frozen=True)
class Meta:
    """What the generator knows of a value: enough to pick ops that apply to it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _unary_out(name: str, m: Meta) -> list[Meta] | None:
    if name == "sigmoid" and m.dtype.is_complex:
        return None
    if name == "t":
        return [Meta((m.shape[1], m.shape[0]), m.dtype)] if len(m.shape) == 2 else None
    if name == "slice":
        return [Meta((*m.shape[:-1], 64), m.dtype)] if m.shape and m.shape[-1] >= 96 else None
    if name == "expand":
        return [Meta((160, m.shape[0]), m.dtype)] if len(m.shape) == 1 else None
    return [m]


def _binary_out(name: str, a: Meta, b: Meta) -> list[Meta] | None:
    dtype = torch.promote_types(a.dtype, b.dtype)
    if name == "matmul":
        if len(a.shape) != 2 or len(b.shape) not in (1, 2) or a.shape[1] != b.shape[0]:
            return None
        return [Meta((a.shape[0],) if len(b.shape) == 1 else (a.shape[0], b.shape[1]), dtype)]
    try:
        shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    except RuntimeError:
        return None
    return [Meta(shape, dtype)] * (2 if name == "pair" else 1)


class _Generator:
    def __init__(self, rng: random.Random, mode: str, max_depth: int) -> None:
        self.rng, self.mode, self.max_depth = rng, mode, max_depth
        self.shapes: dict[str, int] = dict.fromkeys(
            ("rpc", "nested", "relay", "stop", "unused", "remote", "parallel", "returned_args", "packed", "custom"), 0)

    def _pick(self, n: int) -> int:
        """An index of ``n`` values, the recent ones more often."""
        if self.rng.random() < 0.6:
            return self.rng.randrange(max(0, n - 3), n)
        return self.rng.randrange(n)

    def _local(self, metas: list[Meta], ancestry: list[set[int]], ops: list[Any]) -> None:
        r = self.rng
        for _ in range(10):  # tries: not every op applies to every value
            if r.random() < 0.55:
                name = r.choice(UNARY)
                args = [self._pick(len(metas))]
                outs = _unary_out(name, metas[args[0]])
            else:
                name = r.choice(BINARY)
                args = [self._pick(len(metas)), self._pick(len(metas))]
                outs = _binary_out(name, metas[args[0]], metas[args[1]])
            if outs is None:
                continue
            param = round(r.uniform(0.5, 1.3) * r.choice((1, -1)), 3) if name in ("scale", "addc") else None
            ops.append(("local", name, args, param))
            self.shapes["custom"] += name == "custom"
            inherited = set().union(*(ancestry[i] for i in args))
            for out in outs:
                metas.append(out)
                ancestry.append(set(inherited))
            return

    def _call(self, here: str, metas: list[Meta], ancestry: list[set[int]], depth: int,
              last_results: list[int], kind: str) -> tuple[Any, list[Meta], set[int]]:
        r = self.rng
        to = here if r.random() < 0.04 else r.choice([w for w in WORKERS if w != here])
        count = r.choice((1, 1, 1, 2, 2, 3))
        args: list[int] = []
        if last_results and r.random() < RELAY_CHANCE:
            args = list(last_results[:count]) if r.random() < 0.5 else [r.choice(last_results)]
            self.shapes["relay"] += 1
        while len(args) < count:
            args.append(self._pick(len(metas)))
        if len(args) >= 2 and r.random() < 0.1:
            args[1] = args[0]  # one tensor passed twice
        spec, out_metas = self.spec(to, [metas[i] for i in args], depth + 1)
        self.shapes["rpc"] += 1
        self.shapes["nested"] += depth >= 1
        self.shapes["remote"] += kind == "remote"
        return (kind, to, spec, args, len(out_metas)), out_metas, set().union(*(ancestry[i] for i in args))

    def spec(self, here: str, arg_metas: list[Meta], depth: int) -> tuple[dict[str, Any], list[Meta]]:
        """The spec ``here`` runs on ``arg_metas``, and what it returns."""
        r = self.rng
        metas = list(arg_metas)
        n_args = len(metas)
        # which received values (arguments of a call, results of calls made here) each
        # value depends on: FAST mode needs every one of them to reach an output
        ancestry: list[set[int]] = [{i} if depth else set() for i in range(n_args)]
        received = set(range(n_args)) if depth else set()
        ops: list[Any] = []
        last_results: list[int] = []
        made_calls = False
        for _ in range(r.randint(3, 9) if depth == 0 else r.choice((0, 0, 1, 2, 3, 4))):
            x = r.random()
            calls: list[tuple[Any, list[Meta], set[int]]] = []
            if depth < self.max_depth and x < 0.42:
                kind = "remote" if r.random() < 0.08 else "rpc"
                calls.append(self._call(here, metas, ancestry, depth, last_results, kind))
                ops.append(calls[0][0])
            elif depth < self.max_depth and x < 0.48:
                calls = [self._call(here, metas, ancestry, depth, [], "rpc") for _ in range(r.randint(2, 3))]
                ops.append(("parallel", [call[0] for call in calls]))
                self.shapes["parallel"] += 1
            else:
                self._local(metas, ancestry, ops)
                continue
            made_calls = True
            last_results = []
            for _, outs, inherited in calls:
                for out in outs:
                    received.add(len(metas))
                    last_results.append(len(metas))
                    ancestry.append(inherited | {len(metas)})
                    metas.append(out)
        if depth and r.random() < 0.2:
            outputs = sorted(r.sample(range(n_args), r.randint(1, n_args)))  # arguments, unchanged
            self.shapes["returned_args"] += 1
        else:
            outputs = []
            for _ in range(r.choice((1, 1, 1, 2, 2, 3)) if depth else r.randint(1, 4)):
                last = len(metas) - 1
                outputs.append(last if r.random() < 0.5 and last not in outputs else r.randrange(len(metas)))
        reached = set().union(*(ancestry[o] for o in outputs))
        unreached = [i for i in sorted(received) if i not in reached]
        if unreached and (self.mode == "fast" or r.random() < 0.4):
            # fold them into an output, weakly
            target = r.randrange(len(outputs))
            params = [(round(r.uniform(0.1, 1), 3), round(r.uniform(-1, 1), 3)) for _ in unreached]
            ops.append(("local", "sink", [outputs[target], *unreached], params))
            metas.append(metas[outputs[target]])
            ancestry.append(set().union(*(ancestry[i] for i in [outputs[target], *unreached])))
            outputs[target] = len(metas) - 1
        elif unreached:
            self.shapes["unused"] += 1
        uses = collections.Counter(outputs)
        for op in ops:
            uses.update(op[2] if op[0] == "local" else [i for call in op[1] for i in call[3]]
                        if op[0] == "parallel" else op[3])
        self.shapes["stop"] += any(uses[i] > 1 for i in received)
        spec = {
            "ops": ops, "outputs": outputs, "tuple": len(outputs) > 1 or r.random() < 0.15,
            "async": made_calls or r.random() < 0.5,
            "packed": r.random() < 0.25,  # arguments in a keyword list, the result in a dict
        }
        self.shapes["packed"] += depth > 0 and spec["packed"]
        return spec, [metas[i] for i in outputs]


@dataclass
class Program:
    seed: int
    mode: str
    spec: dict[str, Any]
    leaves: list[torch.Tensor]
    coefficients: list[tuple[float, float]]
    used: list[int]  # the outputs the loss takes
    retain_graph: bool
    two_roots: bool
    shapes: dict[str, int] = field(default_factory=dict)  # what the generator made, counted


def mode_of(seed: int) -> str:
    """The mode a seed's program runs in: even seeds FAST, odd SMART."""
    return "fast" if seed % 2 == 0 else "smart"


def fault_of(seed: int) -> str:
    """Where a seed's program fails, with faults: by pairs of seeds, so both modes see both."""
    return "forward" if seed % 4 < 2 else "backward"


def make_program(seed: int, mode: str) -> Program:
    """The program of ``seed``, for ``mode`` ("fast" or "smart")."""
    r = random.Random(seed)
    generator = _Generator(r, mode, max_depth=r.choice((1, 2, 2, 3)))
    base = torch.float64 if r.random() < 0.7 else torch.float32
    metas, requires = [], []
    for _ in range(r.randint(2, 5)):
        metas.append(Meta(r.choice(SHAPES), torch.complex64 if r.random() < 0.08 else base))
        requires.append(r.random() > 0.1)
    spec, outs = generator.spec("worker0", metas, 0)
    coefficients = [(round(r.uniform(0.1, 1), 3), round(r.uniform(-1, 1), 3)) for _ in outs]
    if mode == "smart" and len(outs) > 1 and r.random() < 0.3:
        used = sorted(r.sample(range(len(outs)), r.randint(1, len(outs) - 1)))
    else:
        used = list(range(len(outs)))
    retain_graph, two_roots = r.random() < 0.2, r.random() < 0.15
    values = torch.Generator().manual_seed(seed)
    leaves = [(torch.randn(m.shape, dtype=m.dtype, generator=values) * 0.7).requires_grad_(req)
              for m, req in zip(metas, requires, strict=True)]
    return Program(seed, mode, spec, leaves, coefficients, used, retain_graph, two_roots, generator.shapes)


class Injected(Exception):
    """The failure of a program with a fault (see with_fault)."""


def with_fault(program: Program, fault: str) -> bool:
    """Make one call of ``program`` (picked by its seed) fail in its forward
    (``"forward"``: the callee raises) or in its backward (``"backward"``: its first
    output's gradient raises). False when the program makes no call."""
    specs: list[dict[str, Any]] = []

    def walk(spec: dict[str, Any]) -> None:
        for op in spec["ops"]:
            for call in op[1] if op[0] == "parallel" else [op] if op[0] in ("rpc", "remote") else []:
                specs.append(call[2])
                walk(call[2])

    walk(program.spec)
    if specs:
        random.Random(program.seed).choice(specs)["fault"] = fault
    return bool(specs)


# -- running a spec (here, or on the worker a call names) ---------------------------
def _term(value: torch.Tensor, c: float, d: float, reduce: Any = torch.sum) -> torch.Tensor:
    """A real scalar of ``value`` with a gradient everywhere."""
    real = value.real if value.is_complex() else value
    term = c * reduce(real * real) + d * reduce(real)
    if value.is_complex():
        term = term + 0.3 * reduce(value.imag * value.imag)
    return term


class _FailInBackward(torch.autograd.Function):
    """The identity, whose backward raises (a fault, see with_fault)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Injected("injected in a backward")


class _Double(torch.autograd.Function):
    """2x with a backward in Python (such jobs run on the worker's thread pool)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _local_op(name: str, ins: list[torch.Tensor], param: Any) -> list[torch.Tensor]:
    a = ins[0]
    b = ins[1] if len(ins) > 1 else a
    ops = {
        "sin": lambda: [torch.sin(a)], "tanh": lambda: [torch.tanh(a)], "sigmoid": lambda: [torch.sigmoid(a)],
        "scale": lambda: [a * param], "addc": lambda: [a + param], "sq": lambda: [a * torch.tanh(a) * 0.5],
        "mul1": lambda: [a * 1], "t": lambda: [a.t()], "slice": lambda: [a[..., :64]],
        "expand": lambda: [a.expand(160, a.shape[0])], "view": lambda: [a.view_as(a)], "clone": lambda: [a.clone()],
        "custom": lambda: [_Double.apply(a)],
        "add": lambda: [a + b], "mul": lambda: [a * b], "sub": lambda: [a - b], "tmul": lambda: [a * torch.tanh(b)],
        "pair": lambda: [a * b, a - 2 * b],
    }
    if name == "matmul":
        dtype = torch.promote_types(a.dtype, b.dtype)
        return [(a.to(dtype) @ b.to(dtype)) / math.sqrt(a.shape[-1])]
    if name == "sink":
        out = a
        for value, (c, d) in zip(ins[1:], param, strict=True):
            # (a mean: a sum, broadcast over ``out``, would scale the gradients by its size)
            out = out + _term(value, c, d, torch.mean)
        return [out]
    return ops[name]()


# the local run's intermediate values, to scale the tolerance (see compare)
_intermediates: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "_intermediates", default=None)


def _note_intermediates(values: list[torch.Tensor]) -> None:
    noted = _intermediates.get()
    if noted is not None:
        for value in values:
            if value.requires_grad and value.grad_fn is not None:
                value.retain_grad()
                noted.append(value)


async def _interpret(spec: dict[str, Any], args: tuple[torch.Tensor, ...] | list[torch.Tensor],
                     distributed: bool) -> Any:
    values = list(args)
    for op in spec["ops"]:
        if op[0] == "local":
            values.extend(_local_op(op[1], [values[i] for i in op[2]], op[3]))
        elif op[0] == "parallel":
            for results in await asyncio.gather(*(_call(call, values, distributed) for call in op[1])):
                values.extend(results)
        else:
            values.extend(await _call(op, values, distributed))
    if not distributed:
        _note_intermediates(values[len(args):])
    outs = [values[i] for i in spec["outputs"]]
    fault = spec.get("fault")
    if fault == "forward":
        raise Injected("injected in a forward")
    if fault == "backward" and outs[0].requires_grad:
        outs[0] = _FailInBackward.apply(outs[0])
    return tuple(outs) if spec["tuple"] else outs[0]


async def _call(op: Any, values: list[torch.Tensor], distributed: bool) -> list[torch.Tensor]:
    kind, to, spec, args, n_out = op
    ins = [values[i] for i in args]
    if not distributed:
        result = await _interpret(spec, ins, False)
    elif spec["packed"]:
        how = {"args": (spec,), "kwargs": {"values": ins}}
        if kind == "rpc":
            result = (await ag.rpc_async(to, run_spec_packed, **how))["result"]
        else:
            result = (await ag.remote(to, run_spec_packed, **how).to_here())["result"]
    else:
        fn = run_spec if spec["async"] else run_spec_sync
        if kind == "rpc":
            result = await ag.rpc_async(to, fn, args=(spec, *ins))
        else:
            result = await ag.remote(to, fn, args=(spec, *ins)).to_here()
    results = list(result) if isinstance(result, tuple) else [result]
    assert len(results) == n_out, (len(results), n_out)
    return results


async def run_spec(spec: dict[str, Any], *args: torch.Tensor) -> Any:
    """The remote function of a call: its callee's spec."""
    return await _interpret(spec, args, True)


async def run_spec_packed(spec: dict[str, Any], *, values: list[torch.Tensor]) -> dict[str, Any]:
    """The same with the arguments in a keyword list and the result in a dict."""
    return {"result": await _interpret(spec, values, True)}


def run_spec_sync(spec: dict[str, Any], *args: torch.Tensor) -> Any:
    """The same as a plain function, for a spec that makes no call (nothing to await)."""
    coroutine = _interpret(spec, args, True)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a spec without calls awaited something")


# -- the two runs ---------------------------------------------------------------------
class NoGradient(Exception):
    """The program's loss does not require grad (nothing to compare)."""


def _losses(program: Program, outs: Any) -> list[torch.Tensor]:
    outs = outs if isinstance(outs, tuple) else (outs,)
    taken = [i for i in program.used if outs[i].requires_grad]
    if not taken:
        raise NoGradient
    losses = [functools.reduce(operator.add, [_term(outs[i], *program.coefficients[i]) for i in taken])]
    if program.two_roots:
        losses.append(functools.reduce(operator.add, [_term(outs[i], 0.2, 0.5) for i in taken]))
    return losses


async def run_local(program: Program) -> tuple[list[torch.Tensor | None], float]:
    """The leaves' gradients by torch's own autograd, and the largest gradient of any
    intermediate value. Raises NoGradient."""
    leaves = local_copies(*program.leaves)
    noted: list[torch.Tensor] = []
    token = _intermediates.set(noted)
    try:
        outs = await _interpret(program.spec, leaves, False)
    finally:
        _intermediates.reset(token)
    torch.autograd.backward(_losses(program, outs), retain_graph=program.retain_graph)
    if program.retain_graph:
        torch.autograd.backward(_losses(program, outs))
    largest = max([float(v.grad.abs().max()) for v in noted if v.grad is not None], default=0.0)
    return [leaf.grad for leaf in leaves], largest


async def run_distributed(program: Program) -> list[torch.Tensor | None]:
    """The leaves' gradients by one distributed backward (two with retain_graph)."""
    async with ag.autograd.context() as context_id:
        outs = await _interpret(program.spec, program.leaves, True)
        await ag.autograd.backward(context_id, _losses(program, outs), retain_graph=program.retain_graph,
                                   mode=program.mode)
        if program.retain_graph:
            await ag.autograd.backward(context_id, _losses(program, outs), mode=program.mode)
        grads = ag.autograd.get_gradients(context_id)
        return [grads.get(leaf) for leaf in program.leaves]


def compare(program: Program, got: list[torch.Tensor | None], want: list[torch.Tensor | None],
            largest: float) -> list[str]:
    """What differs between the two runs' gradients.

    The engine adds a node's shares in another order than torch, so the tolerance
    grows with the largest gradient flowing anywhere (``x - x`` under a large gradient
    cancels differently), and is float32's when any leaf is not float64."""
    exact = all(leaf.dtype == torch.float64 for leaf in program.leaves)
    tolerance = 1e-9 if exact else 2e-4
    problems = []
    for k, (leaf, g, w) in enumerate(zip(program.leaves, got, want, strict=True)):
        if w is None:
            if g is not None and bool(g.abs().max() > 0):
                problems.append(f"leaf {k}: a gradient where local autograd gives none")
            continue
        if g is None:
            problems.append(f"leaf {k}: no gradient")
        elif g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"leaf {k}: {tuple(g.shape)} {g.dtype}, local {tuple(w.shape)} {w.dtype}")
        else:
            error = float((g - w).abs().max())
            allowed = tolerance * (float(w.abs().max()) + 1) + (1e-13 if exact else 1e-5) * largest
            if error > allowed:
                problems.append(f"leaf {k} {tuple(leaf.shape)} {leaf.dtype}: error {error:.3g} > {allowed:.3g}")
    return problems


def usable(want: list[torch.Tensor | None]) -> bool:
    """Whether the local gradients make a fair oracle (finite, not huge)."""
    return all(w is None or (bool(torch.isfinite(w).all()) and float(w.abs().max()) <= 1e6) for w in want)


async def check(program: Program) -> list[str]:
    """Run ``program`` both ways; what differs (empty: the same). Raises NoGradient."""
    want, largest = await run_local(program)
    if not usable(want):
        raise NoGradient
    return compare(program, await run_distributed(program), want, largest)


async def run_with_fault(program: Program, fault: str) -> tuple[str, list[str]]:
    """Run ``program`` distributed with one call failing (see with_fault): what
    happened ("no call", "skipped": no gradient, "failed", or "unreached": the failing
    output took no part) and what is wrong (the caller got another error)."""
    if not with_fault(program, fault):
        return "no call", []
    try:
        await run_distributed(program)
    except NoGradient:
        return "skipped", []
    except (ag.RemoteError, Injected) as error:
        return "failed", [] if f"injected in a {fault}" in str(error) else [f"{type(error).__name__}: {error}"]
    return "unreached", []


# -- state left on the workers ----------------------------------------------------------
def leftovers() -> tuple[int, int, int]:
    """On the worker that runs it: unreturned loans, live contexts, running backwards."""
    from actorgrad.autograd._engine import engine_actor

    info = ag.autograd.debug_info()
    lent = sum(len(held) for held in engine_actor().loans.lent.values())
    return lent, int(info["num_autograd_contexts"]), int(info["num_current_backward_passes"])


def loans_made() -> int:
    """On the worker that runs it: how many gradients it lent so far."""
    from actorgrad.autograd._engine import engine_actor

    return engine_actor().loans.lent_total


async def wait_clean(seconds: float = 3.0) -> dict[str, tuple[int, int, int]]:
    """Every worker's leftovers once none has any, or as they are after ``seconds``
    (loans go back a moment after they were read)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        state = {w: await ag.rpc_async(w, leftovers, timeout=10) for w in WORKERS}
        if not any(any(v) for v in state.values()) or asyncio.get_running_loop().time() > deadline:
            return state
        await asyncio.sleep(0.02)
