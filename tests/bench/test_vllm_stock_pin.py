"""``python -m bench.vllm_stock --pin``: the core layout, the engine's OpenMP binding, the pinning itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import vllm_stock
from bench.vllm_stock import (
    PinLayout,
    allowed_cores,
    apply_layout,
    descendants,
    engine_omp_cores,
    parse_layouts,
    pin_layout,
    pin_threads,
    spawned_on,
    thread_masks,
)

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores")


def test_two_cores_give_the_engine_one_and_the_rest_the_other() -> None:
    layout = pin_layout({0, 1})
    assert layout == PinLayout(frozenset({1}), frozenset({0}), "engine")
    # vLLM's CPU worker runs one OpenMP thread per listed core, bound to it: the engine's core only.
    assert layout.engine_env() == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert "core 1 = the engine" in layout.describe()
    assert "core 0 = CMS, agent, router(s), this client" in layout.describe()


@given(st.sets(st.integers(0, 255), min_size=2, max_size=64))
def test_the_layout_splits_the_allowed_cores(allowed: set[int]) -> None:
    layout = pin_layout(allowed)
    assert len(layout.engine) == 1
    assert layout.engine | layout.rest == allowed
    assert not layout.engine & layout.rest
    bound = layout.engine_env()["VLLM_CPU_OMP_THREADS_BIND"]
    assert {int(c) for c in bound.split(",")} == set(layout.engine)


def test_the_engine_layout_puts_every_engine_process_on_its_core_and_compute_only_the_worker() -> None:
    server = "/work/.venv-vllm/bin/python -m vllm.entrypoints.launchers.grpc_server --model m"
    engine, compute = pin_layout({0, 1}, "engine"), pin_layout({0, 1}, "compute")
    for title in (server, "VLLM::EngineCore", "VLLM::Worker", "VLLM::Worker_TP1"):
        assert engine.cores_for(title) == {1}
    assert engine.spawn_cores() == {1}
    assert compute.cores_for("VLLM::Worker") == compute.cores_for("VLLM::Worker_TP1") == {1}
    assert compute.cores_for(server) == compute.cores_for("VLLM::EngineCore") == {0}
    assert compute.spawn_cores() == {0}
    # The forward pass is bound to the engine's core in both.
    assert engine.engine_env() == compute.engine_env() == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert "API server and EngineCore" in compute.describe()


def test_pin_takes_layouts_in_turn_each_once() -> None:
    assert parse_layouts("", {0, 1}) == [None]
    assert parse_layouts("off", {0, 1}) == [None]
    assert parse_layouts("engine", {0, 1}) == [pin_layout({0, 1}, "engine")]
    assert parse_layouts("off,engine,compute", {0, 1}) == [
        None,
        pin_layout({0, 1}, "engine"),
        pin_layout({0, 1}, "compute"),
    ]
    for bad in ("gpu", "engine,engine", "off,,off"):
        with pytest.raises(ValueError, match="distinct values"):
            parse_layouts(bad, {0, 1})
    assert parse_layouts("off", {0}) == [None]  # unpinned needs no second core
    with pytest.raises(ValueError, match="at least 2"):
        parse_layouts("off,engine", {0})


@pytest.mark.parametrize("allowed", [set(), {3}])
def test_fewer_than_two_cores_cannot_be_split(allowed: set[int]) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        pin_layout(allowed)


def test_the_cli_refuses_pin_on_one_core(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(vllm_stock.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit):
        vllm_stock.main(["--pin", "--engine", "synthetic:8"])
    assert "--pin needs at least 2 usable cores" in capsys.readouterr().err


def test_the_engines_openmp_binding_is_read_from_its_log() -> None:
    log = (
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tVLLM_CPU_OMP_THREADS_BIND='auto'\n"
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n"
    )
    assert engine_omp_cores(log) == "0,1"
    assert engine_omp_cores(log + "(EngineCore pid=2) INFO \tlocal_rank=0, core ids=[1]\n") == "1"
    assert engine_omp_cores("engine ready\n") is None


@needs_two_cores
def test_a_child_forked_in_the_block_starts_on_the_cores_and_the_caller_gets_its_mask_back() -> None:
    before = os.sched_getaffinity(0)
    core = max(before)
    with spawned_on({core}):
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    assert out.strip() == f"[{core}]"
    assert os.sched_getaffinity(0) == before
    with spawned_on(None):
        assert os.sched_getaffinity(0) == before


@needs_two_cores
def test_every_thread_of_a_process_and_its_children_is_pinned() -> None:
    # A child with a second thread and a grandchild: pinning each process of the tree moves them all.
    script = (
        "import subprocess, sys, threading\n"
        "threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import sys; print(1, flush=True); sys.stdin.read()'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "g.stdout.readline()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "g.stdin.close(); g.wait(30)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            tree = descendants(child.pid)
            assert len(tree) == 2
            assert len(os.listdir(f"/proc/{child.pid}/task")) >= 2
            core = min(os.sched_getaffinity(0))
            assert allowed_cores(tree) != {core}
            pinned = sum(pin_threads(pid, {core}) for pid in tree)
            assert pinned >= 3
            assert allowed_cores(tree) == {core}
        finally:
            child.kill()
            child.wait(30)
    assert pin_threads(child.pid, {0}) == 0  # a process that ended: nothing to pin


@needs_two_cores
def test_layouts_in_turn_move_the_threads_and_off_gives_back_their_own_masks() -> None:
    # Two stand-ins: an "engine" whose second thread bound itself to one core (as vLLM's OpenMP
    # thread does), and a "router". Engine layout: both engine threads on the engine's core, the
    # router on the rest; off: the bound thread back on its own core, the others on every core.
    every = os.sched_getaffinity(0)
    layout = pin_layout(every, "engine")
    bound = min(every)
    engine_script = (
        "import os, sys, threading\n"
        "def bound():\n"
        f"    os.sched_setaffinity(0, {{{bound}}})\n"
        "    print(threading.get_native_id(), flush=True)\n"
        "    sys.stdin.read()\n"
        "threading.Thread(target=bound, daemon=True).start()\n"
        "sys.stdin.read()\n"
    )
    with (
        subprocess.Popen(
            [sys.executable, "-c", engine_script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as engine,
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        ) as router,
    ):
        try:
            assert engine.stdout is not None
            bound_tid = int(engine.stdout.readline())
            unpinned = thread_masks([engine.pid, router.pid])
            assert unpinned[bound_tid] == {bound}
            apply_layout(layout, [engine.pid], [router.pid], unpinned, every)
            assert allowed_cores([engine.pid]) == layout.engine
            assert allowed_cores([router.pid]) == layout.rest
            apply_layout(None, [engine.pid], [router.pid], unpinned, every)
            assert os.sched_getaffinity(bound_tid) == {bound}
            assert os.sched_getaffinity(engine.pid) == every
            assert allowed_cores([router.pid]) == every
        finally:
            engine.kill()
            router.kill()
            engine.wait(30)
            router.wait(30)


def test_saved_outputs_pool_into_one_summary_per_layout() -> None:
    # Two runs' rows as the bench prints them: one with layouts in turn, one unpinned alone (no
    # layout column, so "off"). Each layout's pairs hold every round of every run, in order.
    header = "round  streams | direct tok/s TTFT p50 | side     tok/s TTFT p50 | ratio  added | router CPU ms/req | load"
    turns = "\n".join(
        [
            header + " | pinned",
            "    1       16 |         2840   31.0ms | h2       2837   32.7ms |  1.00   +1.7 |              5.94 | 4.4 | engine",
            "    1       16 |         4323   26.0ms | h2       3685   38.9ms |  0.85  +12.9 |              5.31 | 5.7 | off",
            "    2       16 |         4000   30.0ms | h2       4400   34.0ms |  1.10   +4.0 |              4.00 | 5.0 | off",
            "    2       16 |         3000   30.0ms | h2       3000   33.0ms |  1.00   +3.0 |              6.00 | 5.1 | engine",
            "warm-up round done (not counted), load 4.4",
        ]
    )
    alone = "\n".join(
        [
            header,
            "    1       16 |         4486   29.1ms | h2        4277   32.3ms |  0.95   +3.3 |              4.06 | 5.5",
            "    1        1 |          480    6.0ms | h2         534    7.1ms |  1.11   +1.1 |             15.00 | 5.5",
        ]
    )
    pooled = vllm_stock.pool_rounds([turns, alone])
    assert set(pooled) == {"off", "engine"}
    off, engine = pooled["off"], pooled["engine"]
    assert [r.ttft_p50 for r in off.runs[("router-h2", 16)]] == [38.9, 34.0, 32.3]
    assert off.ttft_added(16, "router-h2") == pytest.approx([12.9, 4.0, 3.2])
    assert engine.ratios(16, "router-h2") == pytest.approx([2837 / 2840, 1.0])
    assert len(off.load) == 3 and len(engine.load) == 2  # one per round, whatever the concurrencies
    requests = 16 * dict(vllm_stock.WORKLOAD)[16]
    assert off.runs[("router-h2", 16)][0].router_cpu_s == pytest.approx(5.31 * requests / 1000)
    text, _ = vllm_stock.summarize(off, ((16, 2),), "router-h2")
    assert "TTFT added at 16 streams +4.0 (+3.2–+12.9) ms" in text


def test_layouts_are_compared_round_by_round_within_each_output() -> None:
    # Round numbers restart in each output: a round pairs only with the same round of the same run,
    # and a round where one layout is missing pairs with nothing.
    def row(round_: int, d_ttft: float, r_ttft: float, layout: str) -> str:
        return (
            f"{round_:>5} {16:>8} | {3000:>12} {d_ttft:>6.1f}ms | h2     {3000:>6} {r_ttft:>6.1f}ms | "
            f" 1.00 {r_ttft - d_ttft:>+6.1f} | {5.0:>17.2f} | 5.0 | {layout}"
        )

    first = "\n".join([row(1, 30, 32, "engine"), row(1, 30, 40, "off"), row(2, 30, 35, "off")])
    second = "\n".join([row(1, 28, 29, "off"), row(1, 28, 33, "engine")])
    assert vllm_stock.layout_differences([first, second], "engine", "off", "h2", 16) == pytest.approx(
        [-8.0, 4.0]
    )
    assert vllm_stock.layout_differences([first, second], "engine", "off", "h2", 64) == []
    assert vllm_stock.layout_differences([first, second], "compute", "off", "h2", 16) == []
