"""Functions and classes of a program's ``__main__``: the callee's own where it runs the
same program (as torch finds them by name), a copy by value where it does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actorgrad.wire import Payload
from actorgrad.wire._main_objects import class_fingerprint, fingerprint

ROOT = Path(__file__).parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ACTORGRAD_AUTH_KEY", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(tmp_path: Path, source: str, *launch: str) -> str:
    """Run ``source`` as a script (under ``actorgrad launch`` with ``launch`` arguments,
    or alone); its stdout, after checking that it succeeded."""
    script = tmp_path / "script.py"
    script.write_text(source)
    command = [sys.executable, *(("-m", "actorgrad", "launch", *launch) if launch else ()), str(script)]
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# The parameter-server idiom of torch's RPC tutorials: module state on the callee (a
# dict it fills, a counter, a server created once under a global lock).
STATEFUL = """
import dataclasses, enum, functools, os, threading
import torch
import actorgrad as ag
import actorgrad.collective as C

rank = int(os.environ["RANK"])
STATE = {}
COUNTER = 0
WHO = f"rank{rank}"
server = None
lock = threading.Lock()

def put(k, v):
    STATE[k] = v

def get(k):
    return STATE.get(k)

def bump():
    global COUNTER
    COUNTER += 1
    return COUNTER

def who():
    return WHO

class Server:
    def __init__(self):
        self.calls = 0

def call_server():
    global server
    with lock:
        if server is None:
            server = Server()
        server.calls += 1
        return server.calls

# classes go by name too: their objects are instances of the receiver's own class
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.lin(x)

class Point:
    def __init__(self, x):
        self.x = x

@dataclasses.dataclass
class Pair:
    a: int
    b: int

class Color(enum.Enum):
    RED = 1

class AppError(Exception):
    pass

def make_point(x):
    return Point(x)

def kinds(p, pair, color):
    return type(p) is Point, type(pair) is Pair, color is Color.RED

def raise_app():
    raise AppError("bad")

def net_is_net(net):
    return type(net.local_value()) is Net

class Outer:
    class Inner:
        pass

def is_inner(x):
    return type(x) is Outer.Inner

class Tally:
    def __init__(self):
        self.n = 0

    def add(self, k):
        with lock:  # a module-level lock: the method cannot go by value
            self.n += k
            return self.n

def call_method(method, rref, *args):  # torch's tutorial idiom
    return method(rref.local_value(), *args)

class TensorError(Exception):
    def __init__(self, t):
        super().__init__(t)
        self.t = t

def raise_tensor_error():
    raise TensorError(torch.ones(2))

class CountedSGD(torch.optim.SGD):
    made = 0

    def __init__(self, params, lr):
        with lock:
            type(self).made += 1
        super().__init__(params, lr=lr)

    def step(self, closure=None):  # torch wraps it where one is made (worker0 checks its arguments)
        return super().step(closure)

def made():
    return CountedSGD.made

def make_param():
    return torch.nn.Parameter(torch.ones(2))

# these go by value, as before: a lambda and a wrapper that took another function's name
double = lambda x: x * 2

def base(x):
    return x + 100

@functools.wraps(base)
def wrapped(x):
    return base(x) + 1

async def main():
    await ag.init_rpc(f"worker{rank}")
    if rank == 0:
        net = ag.remote("worker1", Net)
        print("NET", tuple((await net.rpc_async().forward(torch.ones(3, 2))).shape))
        print("NET IS NET", await ag.rpc_async("worker1", net_is_net, args=(net,)))
        point = await ag.rpc_async("worker1", make_point, args=(7,))
        print("POINT", type(point) is Point, point.x)
        print("KINDS", await ag.rpc_async("worker1", kinds, args=(Point(1), Pair(1, 2), Color.RED)))
        try:
            await ag.rpc_async("worker1", raise_app)
        except ag.RemoteError as exc:
            try:
                raise exc.__cause__
            except AppError as cause:
                print("CAUGHT", cause)
        print("NESTED", await ag.rpc_async("worker1", is_inner, args=(Outer.Inner(),)))
        tally = ag.remote("worker1", Tally)
        print("METHOD", [await ag.rpc_async("worker1", call_method, args=(Tally.add, tally, 2)) for _ in range(2)])
        try:
            await ag.rpc_async("worker1", raise_tensor_error)
        except ag.RemoteError as exc:
            print("TENSOR ERROR", type(exc.__cause__) is TensorError, exc.__cause__.t.tolist())
        opt = ag.optim.DistributedOptimizer(CountedSGD, [ag.remote("worker1", make_param)], lr=0.1)
        async with ag.autograd.context() as context_id:
            await opt.step(context_id)
        print("OPTIMIZERS MADE THERE", await ag.rpc_async("worker1", made))
        print("LAMBDA", await ag.rpc_async("worker1", double, args=(3,)))
        print("WRAPPED", await ag.rpc_async("worker1", wrapped, args=(1,)))
        await ag.rpc_async("worker1", put, args=("a", 1))
        print("GET", await ag.rpc_async("worker1", get, args=("a",)))
        print("BUMP", await ag.rpc_async("worker1", bump), await ag.rpc_async("worker1", bump))
        print("WHO", await ag.rpc_async("worker1", who))
        print("SERVER", [await ag.rpc_async("worker1", call_server) for _ in range(3)])
        print("HERE", STATE, COUNTER, server)
    objects = [Pair(rank, 0) if rank == 1 else None]
    await C.broadcast_object_list(objects, src=1)
    gathered = [None, None]
    await C.all_gather_object(gathered, Point(rank))
    print("OBJECTS", type(objects[0]) is Pair, [type(g) is Point for g in gathered])
    await ag.shutdown()

ag.run(main())
"""


@pytest.mark.slow
def test_launched_ranks_use_their_own_module_state_as_in_torch(tmp_path):
    out = _run(tmp_path, STATEFUL, "--nproc", "2")
    assert "GET 1" in out  # the put landed in worker1's STATE (a copy of it, before)
    assert "BUMP 1 2" in out
    assert "WHO rank1" in out
    assert "SERVER [1, 2, 3]" in out  # refers to a global lock: could not be sent by value
    assert "HERE {} 0 None" in out  # and the caller's module was left alone
    assert "NET (3, 1)" in out and "LAMBDA 6" in out and "WRAPPED 102" in out
    assert "NET IS NET True" in out and "POINT True 7" in out  # the receiver's own classes
    assert "KINDS (True, True, True)" in out and "CAUGHT bad" in out
    assert "NESTED True" in out and "METHOD [2, 4]" in out  # nested class, method alone
    assert "TENSOR ERROR True [1.0, 1.0]" in out  # an exception holding a tensor
    assert "OPTIMIZERS MADE THERE 1" in out  # the owner's own optimizer class
    assert out.count("OBJECTS True [True, True]") == 2  # object collectives, on both ranks


ELSEWHERE = """
import asyncio
import actorgrad as ag

OFFSET = 10

def add_offset(x):
    return x + OFFSET

def on_worker2():
    return "ran on " + ag.get_worker_info().name

def forward_to_worker2():
    # this function and on_worker2 came by value: worker1 passes on_worker2 on by value
    # too, although worker2 runs the same program as worker1
    return ag.rpc_sync("worker2", on_worker2)

reports = []

def note(value):
    reports.append(value)
    return len(reports)

def report(value):
    # runs on worker1: calls this program back with its copy of note, and note must
    # run as this program's own, filling its list
    return ag.rpc_sync("worker0", note, args=(value,))

def report_through_worker2(value):
    return ag.rpc_sync("worker2", report_to_worker0, args=(note, value))

def report_to_worker0(func, value):
    return ag.rpc_sync("worker0", func, args=(value,))

def fact(n):  # names itself: its copy's globals hold the copy
    return 1 if n <= 1 else n * fact(n - 1)

def fact_on_worker0(n):
    return ag.rpc_sync("worker0", fact, args=(n,))

async def main():
    group = await ag.local_group(3)  # workers 1 and 2 run another program: copies
    try:
        print("BY VALUE", await ag.rpc_async("worker1", add_offset, args=(1,)))
        print("SAME OBJECT HERE", await ag.rpc_async("worker0", add_offset, args=(1,)))
        print("PASSED ON", await ag.rpc_async("worker1", forward_to_worker2))
        counts = [await ag.rpc_async("worker1", report, args=(i,)) for i in (1, 2)]
        counts.append(await ag.rpc_async("worker1", report_through_worker2, args=(3,)))
        print("CALLED BACK", counts, reports)
        print("RECURSIVE", await ag.rpc_async("worker1", fact_on_worker0, args=(5,)))
    finally:
        await group.shutdown()

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_worker_that_runs_another_program_gets_a_copy(tmp_path):
    out = _run(tmp_path, ELSEWHERE)
    assert "BY VALUE 11" in out
    assert "SAME OBJECT HERE 11" in out
    assert "PASSED ON ran on worker2" in out
    # a copy that came back ran as the program's own function (with its own list)
    assert "CALLED BACK [1, 2, 3] [1, 2, 3]" in out
    assert "RECURSIVE 120" in out  # (its copy named itself: sent on, it recursed for good)


DIFFERS = """
import os
import actorgrad as ag

rank = int(os.environ["RANK"])
if rank == 0:
    def only_here():
        return 1

    class OnlyHere:
        pass

async def main():
    await ag.init_rpc(f"worker{rank}")
    if rank == 0:
        try:
            await ag.rpc_async("worker1", only_here)
        except ag.RemoteError as exc:
            print("REFUSED", exc.remote_type, exc.remote_message)
        try:
            await ag.rpc_async("worker1", repr, args=(OnlyHere(),))
        except ag.RemoteError as exc:
            print("REFUSED CLASS", exc.remote_type, exc.remote_message)
    await ag.shutdown()

ag.run(main())
"""


@pytest.mark.slow
def test_a_function_the_same_program_lacks_elsewhere_is_named(tmp_path):
    out = _run(tmp_path, DIFFERS, "--nproc", "2")
    refused, refused_class = out.split("REFUSED", 1)[1].split("REFUSED CLASS", 1)
    assert "LookupError" in refused and "__main__.only_here" in refused and "no function" in refused
    assert "LookupError" in refused_class and "__main__.OnlyHere" in refused_class
    assert "no class" in refused_class


def test_the_fingerprint_tells_code_apart_and_is_the_same_in_another_process():
    def one() -> int:
        return 1

    def two() -> int:
        return 2  # same bytecode as one: only a constant differs

    assert fingerprint(one.__code__)[2] != fingerprint(two.__code__)[2]
    source = textwrap.dedent("""
        def f(x):
            return x in {"a", "b", "c"} and (lambda y: y + 1)(2)
    """)
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
             "from actorgrad.wire._main_objects import fingerprint\n"
             f"exec({source!r})\nprint(fingerprint(f.__code__))")
    prints = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**_env(), "PYTHONHASHSEED": seed}, check=True).stdout
              for seed in ("1", "2", "3")}
    assert len(prints) == 1  # string hashing differs between them; the fingerprint does not


class _Shape:
    sides = 3

    def area(self) -> float:
        return 1.0

    @property
    def name(self) -> str:
        return "shape"


class _OtherShape:
    sides = 3

    def area(self) -> float:
        return 2.0  # only a constant differs

    @property
    def name(self) -> str:
        return "shape"


def test_the_class_fingerprint_follows_its_code_not_its_state():
    assert class_fingerprint(_Shape)[2] != class_fingerprint(_OtherShape)[2]
    source = textwrap.dedent("""
        class C:
            kinds = {"a", "b", "c"}
            def f(self, x):
                return x in {"a", "b"}
            @staticmethod
            def g():
                return lambda y: y + 1
    """)
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
             "from actorgrad.wire._main_objects import class_fingerprint\n"
             f"exec({source!r})\nprint(class_fingerprint(C))\nC.__slotnames__ = []; C.extra = 1; C.h = lambda self: 0\n"
             "import functools; f = C.f; C.f = functools.wraps(f)(lambda *a: f(*a))\n"
             "from actorgrad.wire import _main_objects; _main_objects._class_prints.clear()\n"
             "print(class_fingerprint(C))")
    prints = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**_env(), "PYTHONHASHSEED": seed}, check=True).stdout
              for seed in ("1", "2")}
    assert len(prints) == 1
    (both,) = prints
    first, second = both.splitlines()
    assert first == second  # attributes set after the class statement leave it alone


def test_a_main_function_sent_by_value_comes_back_as_itself_and_unchanged():
    """Its origin is kept beside it, by identity: not in its __dict__ (which a
    functools.wraps wrapper copies, and which travels with it)."""
    import functools
    import pickle

    from actorgrad.wire._codec import dumps

    main = sys.modules["__main__"]
    source = "def _ag_twice(x):\n    return 2 * x\n"
    exec(source, main.__dict__)  # a function of __main__, as a script or a notebook has
    try:
        func = main._ag_twice
        assert pickle.loads(dumps(func)) is func
        assert vars(func) == {}

        @functools.wraps(func)
        def wrapper(x):  # type: ignore[no-untyped-def]
            return func(x) + 1

        assert pickle.loads(dumps(wrapper)) is not func
        assert pickle.loads(dumps(wrapper))(1) == 3
    finally:
        del main._ag_twice


def test_functions_and_classes_of_other_modules_are_not_affected():
    for obj in (textwrap.dedent, textwrap.TextWrapper, textwrap.TextWrapper.wrap, Path):
        body = bytes(Payload.dump(obj, main_by_name=True).body)  # by reference, as before
        assert obj.__module__.encode() in body and b"_main_objects" not in body, obj
