"""The pace rules of e2e pulls (``QlmQueue._room``): who counts as looser, when a looser pull waits for a
batch closed to the tightest e2e class, and the cautious length of that class."""

from __future__ import annotations

from router.core.qlm import InstanceModel, OutputStats, QlmConfig, QlmQueue
from router.core.request import ScheduleInput
from tests.router.core.test_qlm import paced_model


def e2e(
    rid: str, budget_s: float, *, arrival: float, out: int = 100, prompt: int = 200, cls: str = "batch"
) -> ScheduleInput:
    return ScheduleInput(
        request_id=rid,
        prompt_tokens=prompt,
        e2e_slo_ms=budget_s * 1e3,
        max_tokens=out,
        slo_class=cls,
        arrival_s=arrival,
    )


def pulled(q: QlmQueue, r: ScheduleInput, now_s: float) -> bool:
    q.push(r, now_s)
    out = q.pump(now_s)
    q.check_invariants()
    return [d.request.request_id for d in out] == [r.request_id]


def test_a_later_request_of_the_same_class_is_not_held_back_as_a_looser_one() -> None:
    # x (45 s budget, 4,000 tokens at most, nothing learned: all of them) has run 35 s at 10 ms a step:
    # ~560 tokens to go, done at ~40.6 s, on time. A request of x's own class arriving at 35 s (its
    # deadline 80 s, later than x's) with a 60,000-token prompt stalls x 6 s: x then misses. It is as
    # tight as x (the same e2e budget), so it is pulled: holding back a request of the class it would
    # slow trades one for the other. Judged by deadline it counted as looser and waited.
    def queue() -> QlmQueue:
        q = QlmQueue(QlmConfig(eviction="off"), [paced_model()], 6000.0, 50.0)
        q.push(e2e("x", 45.0, arrival=0.0, out=4000), 0.0)
        assert len(q.pump(0.0)) == 1
        return q

    assert pulled(queue(), e2e("r", 45.0, arrival=35.0, prompt=60_000), 35.0)
    # A looser class (600 s) with the same prompt is still held back for x.
    assert not pulled(queue(), e2e("r", 600.0, arrival=35.0, prompt=60_000), 35.0)


def test_a_looser_pull_that_can_wait_waits_while_the_batch_is_closed_to_the_tightest_class() -> None:
    # A 3 s class ("alerts", 100 tokens: 1 s of decoding) was seen lately. A 40,000-token prompt of a
    # 600 s request is still in its prefill (4 s of it): a request of the tight class arriving now
    # would miss, the batch is closed to it. A looser pull that can wait for it to open (600 s, ~1 s of
    # work) waits; one that cannot (its deadline 9 s away, ~10 s of work) is pulled, so the batch never
    # freezes with requests that would miss waiting.
    def queue() -> QlmQueue:
        q = QlmQueue(QlmConfig(eviction="off"), [paced_model()], 6000.0, 50.0)
        q.push(e2e("t", 3.0, arrival=30.0, cls="alerts"), 30.0)
        assert len(q.pump(30.0)) == 1
        q.finished("t", 100, 31.0)
        q.push(e2e("l", 600.0, arrival=40.0, prompt=40_000), 40.0)
        assert len(q.pump(40.0)) == 1
        return q

    assert not pulled(queue(), e2e("r", 600.0, arrival=40.0), 40.0)
    assert pulled(queue(), e2e("r", 9.0, arrival=40.0, out=1000), 40.0)
    # With no tight class seen in the last 30 s, nothing is held back.
    q = queue()
    q.pump(75.0)
    assert pulled(q, e2e("r", 600.0, arrival=75.0), 75.0)


def test_the_room_kept_for_the_tightest_class_counts_its_running_answers_as_lower_bounds() -> None:
    # The tight class ("alerts", 3 s, 200 tokens at most) has two short answers finished (20 tokens) and
    # eight still running at 150 tokens or more: its answers are long, the short ones merely ended
    # first. A looser pull with a 20,000-token prompt (2 s of prefill ahead of the next alert) leaves a
    # 20-token alert on time and a 150-token one late: judged by the finished answers alone it was
    # pulled and the next alerts missed behind it; judged with the running ones, it waits.
    def queue() -> QlmQueue:
        q = QlmQueue(QlmConfig(eviction="off"), [paced_model()], 6000.0, 50.0)
        q.push(e2e("t", 3.0, arrival=30.0, out=200, cls="alerts"), 30.0)
        assert len(q.pump(30.0)) == 1
        q.finished("t", 20, 30.22)  # 20 tokens at 10 ms: the learned step stays the profile's
        q.stats.observe("alerts", 20, 200)
        for k in range(8):
            q.stats.started("alerts", f"a{k}")
            q.stats.progress("alerts", f"a{k}", 0.75)
        assert q.stats.estimate("alerts", 200)[0] == 20.0
        assert q.stats.cautious("alerts", 200)[0] > 120.0
        q.push(e2e("l", 600.0, arrival=40.0), 40.0)
        assert len(q.pump(40.0)) == 1
        return q

    assert not pulled(queue(), e2e("r", 600.0, arrival=40.0, prompt=20_000), 40.0)
    # A 2,000-token prompt (0.2 s) leaves the alert on time even at its long answer: pulled.
    assert pulled(queue(), e2e("r", 600.0, arrival=40.0, prompt=2_000), 40.0)


def test_the_cautious_estimate_is_the_finished_one_when_nothing_runs() -> None:
    stats = OutputStats()
    for k in range(10):
        stats.observe("c", 40 + 20 * (k % 2), 100)
    assert stats.cautious("c", 100) == stats.estimate("c", 100)
    stats.started("c", "running")
    stats.progress("c", "running", 0.9)
    assert stats.cautious("c", 100)[0] > stats.estimate("c", 100)[0]
    assert OutputStats().cautious("c", 100) == (100.0, 0.0)


def growing_model() -> InstanceModel:
    # 10 ms a step for each request in the batch (two requests: 20 ms); otherwise paced_model's.
    return paced_model(step_s=lambda b, t: 0.01 * b)


def tight_beside_two_loose() -> QlmQueue:
    """Two 600 s requests running on :func:`growing_model`, beside x (15 s, 1,000 tokens) and z (15 s,
    100 tokens) of the tight class ``api``."""
    q = QlmQueue(QlmConfig(eviction="off"), [growing_model()], 6000.0, 50.0)
    for r in (
        e2e("l1", 600.0, arrival=0.0),
        e2e("l2", 600.0, arrival=0.0),
        e2e("x", 15.0, arrival=0.0, out=1000, cls="api"),
        e2e("z", 15.0, arrival=0.0, out=100, cls="api"),
    ):
        assert pulled(q, r, 0.0)
    return q


def test_a_looser_pull_that_can_wait_waits_while_the_batch_is_slower_than_a_tighter_request_needs() -> None:
    # Two 600 s requests run; x (15 s, 1,000 tokens, nothing learned: all of them) joins them and
    # needs a step of ~15 ms (an idle instance runs 10), where the batch of three already runs 30:
    # x is late at its length from the start, so the rule that a pull may not turn a running request
    # late spares it. z (x's class, 100 tokens at most) joins too, and with it the tight class is
    # still joinable (100 tokens at 50 ms: 5 s of its 15). A 600 s pull that can wait for x to end
    # (its deadline minutes away) waits: the batch is slower than x's pace. One whose deadline is 7 s
    # away (1 s of work, x ends in ~10) cannot wait, and is pulled (it meets at the grown batch's step).
    def queue() -> QlmQueue:
        q = tight_beside_two_loose()
        x = next(r for run in q.running for r in run.values() if r.request_id == "x")
        assert 0.0145 < x.pace_s < 0.015
        return q

    assert not pulled(queue(), e2e("r", 600.0, arrival=0.0), 0.0)
    assert pulled(queue(), e2e("r", 600.0, arrival=-593.0), 0.0)
    # A pull of x's own class is not held to x's pace.
    assert pulled(queue(), e2e("r", 15.0, arrival=0.0, out=100, cls="api"), 0.0)


def test_the_pace_a_pull_needs_is_sized_with_its_class_running_answers_as_lower_bounds() -> None:
    # The class's two finished answers are short (20 of 200 tokens) and eight are running past 150 (the estimate: ~144):
    # a request of the class pulled now needs the pace of its long answer, not of the finished ones.
    q = QlmQueue(QlmConfig(eviction="off"), [growing_model()], 6000.0, 50.0)
    q.stats.observe("api", 20, 200)
    q.stats.observe("api", 20, 200)
    for k in range(8):
        q.stats.started("api", f"a{k}")
        q.stats.progress("api", f"a{k}", 0.75)
    long_answer, _ = q.stats.cautious("api", 200)
    assert long_answer > 140.0
    q.push(e2e("x", 15.0, arrival=0.0, out=200, cls="api"), 0.0)
    assert len(q.pump(0.0)) == 1
    x = next(iter(q.running[0].values()))
    # 15 s less the prompt's prefill (20 ms), over at least the long answer.
    assert x.pace_s <= (15.0 - 0.02) / long_answer + 1e-9
    # A class that could not keep even its mean's pace on an idle instance bounds nothing.
    q.push(e2e("y", 1.0, arrival=0.0, out=200, cls="api"), 0.0)
    q.pump(0.0)
    y = next(r for r in q.running[0].values() if r.request_id == "y")
    assert y.pace_s == float("inf")


def test_a_looser_pull_that_misses_even_pulled_now_waits_while_the_batch_is_slower_than_a_tighter_request_needs() -> (
    None
):
    # The batch of the test above: x (15 s) needs ~15 ms a step, the grown batch of five runs 50. A 600 s
    # pull whose deadline is 3 s away cannot wait for x, and misses even pulled now (100 tokens at 50 ms:
    # 5 s): it is lost either way, so it waits rather than slow x. (It was pulled: it could not wait.)
    assert not pulled(tight_beside_two_loose(), e2e("r", 600.0, arrival=-597.0), 0.0)
    # With no tighter request running there, a late pull is not held back for anyone.
    q = QlmQueue(QlmConfig(eviction="off"), [growing_model()], 6000.0, 50.0)
    for r in (e2e("l1", 600.0, arrival=0.0), e2e("l2", 600.0, arrival=0.0)):
        assert pulled(q, r, 0.0)
    assert pulled(q, e2e("r", 600.0, arrival=-599.5), 0.0)


def test_a_looser_request_cannot_wait_behind_the_tighter_requests_queued_ahead_of_it() -> None:
    # Nothing runs; eight 15 s requests (1,000 tokens each, nothing learned: all of them) are queued on
    # the instance's virtual queue, ahead of any 600 s request. The instance makes 400 tokens a second
    # (4 slots at 10 ms): they take 20 s at its throughput (Eq. 2), the last of them 10 s more. A 600 s
    # request with 30 s left (1 s of work) would miss waiting for them; with 60 s left it can wait.
    q = QlmQueue(QlmConfig(eviction="off"), [growing_model()], 6000.0, 50.0)
    for k in range(8):
        q.push(e2e(f"t{k}", 15.0, arrival=0.0, out=1000, cls="api"), 0.0)
    assert len(q) == 8
    late = q.make(e2e("r", 600.0, arrival=-570.0), 0.0)
    assert not q._can_wait(0, [], late, 0.0)
    assert q._can_wait(0, [], q.make(e2e("s", 600.0, arrival=-540.0), 0.0), 0.0)


def test_the_room_kept_for_the_tightest_class_follows_the_odds_of_the_looser_pull_held_for_it() -> None:
    # The tight class ("alerts", 3 s) has learned answers of 40 or 160 tokens (mean 100, spread ~60): a
    # 14,000-token looser prompt (1.4 s of prefill ahead of the next alert) leaves that alert on time at
    # its mean answer, late at its 90 % one. The looser class ("batch") has learned answers of half its
    # 200 tokens (spread 50); one of them runs and frees its slot in ~0.5 s. A looser pull with minutes
    # of slack waits for the room (the alert's tail protected). One whose deadline is 3.1 s away would,
    # held until that slot frees, end by it only at its ~64 % answer: the alert is then protected at
    # that quantile, not its 90 %, and the pull goes. (Protecting the tail of the tight class against
    # every looser pull kept a looser class with little slack waiting until it could wait no longer,
    # and it then went late: answers + summaries, hints + dossiers, docs/papers.md.)
    def queue() -> QlmQueue:
        q = QlmQueue(QlmConfig(eviction="off"), [paced_model()], 6000.0, 50.0)
        for k in range(20):
            q.stats.observe("alerts", 40 if k % 2 else 160, 200)
            q.stats.observe("batch", 50 if k % 2 else 150, 200)
        q.push(e2e("t", 3.0, arrival=30.0, out=200, cls="alerts"), 30.0)
        assert len(q.pump(30.0)) == 1
        q.finished("t", 100, 31.0)
        q.push(e2e("l", 600.0, arrival=40.0), 40.0)
        assert len(q.pump(40.0)) == 1
        return q

    def pull(left_s: float) -> bool:
        return pulled(queue(), e2e("r", 600.0, arrival=40.0 + left_s - 600.0, out=200, prompt=14_000), 40.0)

    assert not pull(600.0)
    assert pull(3.1)


def test_a_tighter_request_whose_class_has_no_finished_answer_keeps_the_default_tpot_as_its_pace() -> None:
    # Four 600 s requests run on growing_model; x (15 s, 2,000 tokens at most) joins them. Nothing of its
    # class has finished, so its answer is taken at all 2,000 tokens, which even an idle instance (10 ms
    # a step) cannot decode in 15 s. That cap is no sign of a lost cause: x keeps the default TPOT (50
    # ms) as its pace, and a 600 s pull that can wait (the batch of six would run 60 ms) waits. Judged
    # lost, x bounded nothing and the pull went ahead.
    def queue(learned: bool) -> QlmQueue:
        q = QlmQueue(QlmConfig(eviction="off"), [growing_model()], 6000.0, 50.0)
        if learned:
            q.stats.observe("api", 1900, 2000)
            q.stats.observe("api", 2000, 2000)
        for k in range(4):
            assert pulled(q, e2e(f"l{k}", 600.0, arrival=0.0), 0.0)
        assert pulled(q, e2e("x", 15.0, arrival=0.0, out=2000, cls="api"), 0.0)
        return q

    q = queue(learned=False)
    x = next(r for r in q.running[0].values() if r.request_id == "x")
    assert x.pace_s == 0.05
    assert not pulled(q, e2e("r", 600.0, arrival=0.0), 0.0)
    # Once the class's answers are learned and x still misses at its mean on an idle instance, it is a
    # lost cause: it bounds nothing, and the pull goes ahead.
    q = queue(learned=True)
    x = next(r for r in q.running[0].values() if r.request_id == "x")
    assert x.pace_s == float("inf")
    assert pulled(q, e2e("r", 600.0, arrival=0.0), 0.0)
