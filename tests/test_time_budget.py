"""`train.max_time`: the run ends inside the budget with the learning-rate schedule complete (a simulated clock
drives the budget exactly as the trainer does), and a killed time-budget run resumes with its clock (a real run)."""

import dataclasses
import json
import math
import random
import re

import pytest
import torch
from forked_ranks import kill_when, run_job

from conftest import TINY, train_args
from llm.config import TrainConfig, build_config
from llm.errors import UserError
from llm.runtime.distributed import DistInfo
from llm.train.schedule import lr_multiplier
from llm.train.time_budget import TimeBudget

ONE_RANK = DistInfo(0, 0, 1, 1, torch.device("cpu"))
RANK_0_OF_2 = DistInfo(0, 0, 2, 2, torch.device("cpu"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def simulate(t: TrainConfig, step_time, eval_time, save_time, state=None, start=0, kill_after=None, info=ONE_RANK,
             saves=None):
    """Drive a TimeBudget through the trainer's sequence of calls on a fake clock, with evaluations and checkpoints
    every t.eval_every and t.save_every steps. Returns (multiplier used by each step, seconds on the clock when the
    run ended, the state saved at the last checkpoint with the scheduler's next multiplier, its step); `saves`, a
    list, gets the step of every checkpoint."""
    clock = FakeClock()
    budget = TimeBudget(t, info, clock)
    budget.load_state_dict(state and state["budget"], start)
    budget.start(start)
    step, used, saved = start, [], (None, None)
    # the scheduler's value for the first step: computed at its start, or restored from the checkpoint
    next_lr = state["next_lr"] if state else lr_multiplier(step, t, budget)
    last = step >= t.max_steps or budget.out_of_time(step)
    while not last:
        used.append(next_lr)
        clock.now += step_time(step) if callable(step_time) else step_time
        step += 1
        next_lr = lr_multiplier(step, t, budget)  # DeepSpeed steps the schedule at the end of the optimizer step
        last = step >= t.max_steps or budget.out_of_time(step)
        calibrate = budget.calibration_due(step)
        evaluate = calibrate and budget.eval_seconds is None  # a resumed run's calibration only saves
        eval_due = last or evaluate or bool(t.eval_every and step % t.eval_every == 0)
        with budget.overhead("eval" if eval_due else None):
            clock.now += eval_time if eval_due else 0.0
        save_due = last or calibrate or bool(t.save_every and step % t.save_every == 0)
        with budget.overhead("save" if save_due else None):
            if save_due:
                clock.now += save_time
                saved = ({"budget": budget.state_dict(step), "next_lr": next_lr}, step)
                if saves is not None:
                    saves.append(step)
        budget.end_iteration(step, wait=calibrate)
        last = last or budget.spent_by_calibration(calibrate, step)
        if step == kill_after:
            break
    return used, clock.now - 1000.0 + (state["budget"]["elapsed"] if state and state["budget"] else 0.0), *saved


def cosine(t: TrainConfig, progress: float) -> float:
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


@pytest.mark.parametrize("step_time", [0.7, 1.3, lambda step: 3.0 if step == 0 else 0.9])
@pytest.mark.parametrize("eval_every", [0, 25])
def test_the_run_ends_inside_the_budget_with_the_schedule_complete(step_time, eval_every):
    t = TrainConfig(max_time="5m", max_steps=10**6, warmup_steps=10, min_lr_ratio=0.1, eval_every=eval_every,
                    save_every=40)
    used, total, _, _ = simulate(t, step_time, eval_time=4.0, save_time=2.0)
    assert total <= 300.0  # the last step, its evaluation and its checkpoint included
    assert total > 300.0 - 3 * 1.3 - 4.0 - 2.0  # and the budget is used
    assert used[:10] == pytest.approx([(k + 1) / 10 for k in range(10)])  # warmup by steps
    decay = used[10:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))  # a cosine that only falls
    assert used[-1] == pytest.approx(t.min_lr_ratio, abs=2e-3)  # ... to its floor at the last step


def test_costly_evaluations_on_the_way_still_end_the_schedule_at_its_floor():
    """An evaluation of 100 steps' time every 50 steps: the budget less the reserve ended the run at 0.94 of the
    time the schedule was spread over, its last learning rate well above the floor."""
    t = TrainConfig(max_time="10m", max_steps=10**6, warmup_steps=10, min_lr_ratio=0.1, eval_every=50,
                    save_every=0)
    used, total, _, _ = simulate(t, 0.3, eval_time=30.0, save_time=1.0)
    assert total <= 600.0 and used[-1] == pytest.approx(t.min_lr_ratio, abs=2e-3)
    decay = used[10:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    jitter = random.Random(0)  # step times that vary move the last step that fits back and forth: the rate rose
    used, total, _, _ = simulate(t, lambda step: 0.3 * jitter.uniform(0.7, 1.3), eval_time=30.0, save_time=1.0)
    decay = used[10:]
    assert total <= 600.0 and all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_the_step_budget_still_caps_a_time_budget_and_completes_the_schedule():
    t = TrainConfig(max_time="1h", max_steps=50, warmup_steps=5, min_lr_ratio=0.1, eval_every=0, save_every=0)
    used, total, _, last_step = simulate(t, 1.0, eval_time=0.5, save_time=0.5)
    assert len(used) == 50 and last_step == 50 and total < 60
    assert used[-1] == pytest.approx(cosine(t, 44 / 45))


def test_a_resumed_budget_decides_exactly_as_an_uninterrupted_one():
    t = TrainConfig(max_time=200, max_steps=10**6, warmup_steps=5, eval_every=20, save_every=30)
    straight, straight_total, _, _ = simulate(t, 1.1, eval_time=3.0, save_time=1.0)
    first, _, state, tag = simulate(t, 1.1, eval_time=3.0, save_time=1.0, kill_after=75)
    assert tag == 60 and state["budget"]["elapsed"] > 0  # killed at 75: steps 61-75 are lost with their time
    rest, total, _, _ = simulate(t, 1.1, eval_time=3.0, save_time=1.0, state=state, start=60)
    assert first[:60] + rest == pytest.approx(straight)
    assert total == pytest.approx(straight_total) and total <= 200


@pytest.mark.parametrize("longer", [True, False])
def test_a_resume_under_another_max_time_follows_the_new_budget(longer):
    """A finished run resumed with a longer train.max_time trained all the extension at the floor (its schedule's
    progress held at 1): the schedule follows the new budget from there, as it follows a new train.max_steps."""
    t = TrainConfig(max_time=100, max_steps=10**6, warmup_steps=5, min_lr_ratio=0.1, eval_every=0, save_every=0)
    _, first_total, state, tag = simulate(t, 1.0, eval_time=0.5, save_time=0.5, kill_after=None if longer else 50)
    again = dataclasses.replace(t, max_time=200 if longer else 80)
    used, total, _, _ = simulate(again, 1.0, eval_time=0.5, save_time=0.5, state=state, start=tag)
    assert total <= again.max_time and used[-1] == pytest.approx(t.min_lr_ratio, abs=2e-3)
    decay = used[1:]  # the first resumed step at the rate the old schedule had computed for it, as for max_steps
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    if longer:  # about half of the new budget's decay time is left: the rate rises well above the floor
        assert first_total <= 100 and used[0] == pytest.approx(t.min_lr_ratio) and decay[0] > 0.5 and len(used) > 80


def test_a_warmup_longer_than_the_budget_still_keeps_the_final_evaluation_inside_it():
    """The reserve was measured at the end of warmup only: a warmup the budget ends never measured it, and the final
    evaluation and checkpoint ran past the budget."""
    t = TrainConfig(max_time=30, max_steps=10**6, warmup_steps=1000, eval_every=0, save_every=0)
    saves = []
    used, total, _, _ = simulate(t, 0.1, eval_time=3.0, save_time=1.0, saves=saves)
    assert total <= 30 and len(saves) == 2  # the calibration's checkpoint, then the final one
    assert saves[0] * 0.1 > 30 * 0.25  # measured by half the budget, not at its start


def test_a_budget_given_to_a_resumed_run_trained_without_one_is_kept():
    """Resumed past its warmup from a checkpoint of no budget, the run never measured the reserve: it ran past the
    budget by its final evaluation and checkpoint, without a note."""
    t = TrainConfig(max_time=20, max_steps=10**6, warmup_steps=2, eval_every=0, save_every=0)
    saves = []
    _, total, _, _ = simulate(t, 0.1, eval_time=2.0, save_time=1.0, start=10, saves=saves,
                              state={"budget": None, "next_lr": lr_multiplier(10, t)})
    assert saves[0] == 11 and total <= 20


@pytest.mark.parametrize("channel", ["ImmediateBroadcast", "OneLateBroadcast"])
def test_a_calibration_that_leaves_no_room_for_another_step_ends_the_run(monkeypatch, channel):
    """The calibration step's own evaluation and checkpoint were not counted before the next step: it ran, and a
    second evaluation (with its samples) and checkpoint, far past the budget. On a GPU, whose ranks read what rank
    0 publishes a step late, the calibration's is read at once."""
    monkeypatch.setattr("llm.train.time_budget._Broadcast", globals()[channel])
    t = TrainConfig(max_time=10, max_steps=10**6, warmup_steps=2, eval_every=0, save_every=0)
    saves = []
    used, total, _, last_step = simulate(t, 0.1, eval_time=6.0, save_time=1.0, saves=saves, info=RANK_0_OF_2)
    assert len(used) == 2 and saves == [2] and last_step == 2 and total <= 10


@pytest.mark.parametrize("max_time, noted", [(15, True), (300, False)])
def test_a_budget_that_ends_inside_the_warmup_says_so(max_time, noted):
    """A budget shorter than the warmup ended the run before its peak learning rate, with no word of it. The first
    step is slow (compiles), so only the end tells."""
    t = TrainConfig(max_time=max_time, max_steps=10**6, warmup_steps=50, eval_every=0, save_every=0)
    clock = FakeClock()
    budget = TimeBudget(t, ONE_RANK, clock)
    budget.start(0)
    step, notes = 0, []
    while not budget.out_of_time(step):
        clock.now += 10.0 if step == 0 else 0.2
        step += 1
        budget.end_iteration(step)
        notes.append(budget.warmup_note(step))
    assert notes[:-1] == [None] * (len(notes) - 1)  # none before the end
    assert (notes[-1] == f"note: train.max_time=15 s ended the run after {step} steps, inside its warmup of "
            "train.warmup_steps=50: the learning rate neither reached its peak nor decayed; lower "
            "train.warmup_steps") if noted else notes[-1] is None


def test_the_overrun_note_is_for_a_budget_of_a_few_steps_not_for_a_slow_last_step():
    """The note's advice (give the budget many steps) was printed for a long run whose last step was slower than the
    average and ended it a little past its budget."""
    clock = FakeClock()
    long = TimeBudget(TrainConfig(max_time=10, max_steps=10**6, warmup_steps=0), ONE_RANK, clock)
    long.start(0)
    for step in range(1, 11):
        clock.now += 1.5 if step == 10 else 0.95
        long.end_iteration(step)
    assert clock.now - 1000.0 > 10 and long.overrun_note() is None
    short = TimeBudget(TrainConfig(max_time=0.5, max_steps=10**6, warmup_steps=0), ONE_RANK, clock)
    short.start(0)
    for step in (1, 2):
        clock.now += 1.0
        short.end_iteration(step)
    assert short.overrun_note().startswith("note: training took 2.0 s, past train.max_time=0.5 s")
    few = TimeBudget(TrainConfig(max_time=1, max_steps=10**6, warmup_steps=0), ONE_RANK, clock)
    few.start(0)  # FEW_STEPS (3) measured steps are still a few
    for step in (1, 2, 3):
        clock.now += 1.0
        few.end_iteration(step)
    assert few.overrun_note().startswith("note: training took 3.0 s, past train.max_time=1 s")
    tiny = TimeBudget(TrainConfig(max_time=0.001, max_steps=10**6, warmup_steps=0), ONE_RANK, clock)
    tiny.start(0)  # its time said to a tenth of a second was "took 0.0 s, past train.max_time=0.001 s"
    for step in (1, 2):
        clock.now += 0.0021
        tiny.end_iteration(step)
    assert tiny.overrun_note().startswith("note: training took 0.0042 s, past train.max_time=0.001 s")


def _published(max_time, warmup_steps=0, eval_every=0, elapsed=0.0, step=0, step_seconds=1.0, eval_seconds=0.0,
               warmup_end=0.0) -> TimeBudget:
    """A budget deciding from the values rank 0 publishes: training time `elapsed` after `step` steps, steps of
    `step_seconds`, evaluations of `eval_seconds`, warmup ended at `warmup_end`; checkpoints cost nothing."""
    budget = TimeBudget(TrainConfig(max_time=max_time, max_steps=10**6, warmup_steps=warmup_steps,
                                    eval_every=eval_every, save_every=0), ONE_RANK, FakeClock())
    budget._publish([elapsed, step, step_seconds, eval_seconds, 0.0, warmup_end])
    return budget


def test_steps_that_fill_the_budget_exactly_all_run_and_end_the_schedule_at_its_floor():
    budget = _published(max_time=10)  # ten steps of 1 s, nothing reserved
    assert budget.last_step() == 10 and budget.projected_end(10) == 10.0 and not budget.out_of_time(9)
    assert [budget.progress(i) for i in (7, 8, 9)] == [0.8, 0.9, 1.0]


def test_the_evaluation_of_the_last_step_is_the_reserve_not_one_due_on_the_way():
    budget = _published(max_time=12, eval_every=10, eval_seconds=2.0)  # step 10 evaluates: 10 s + 2 s
    assert budget.projected_end(10) == 10.0 and not budget.out_of_time(9) and budget.out_of_time(10)


def test_a_warmup_that_leaves_no_room_for_a_step_ends_at_the_floor_and_one_that_ends_with_the_budget_is_no_note():
    budget = _published(max_time=10, warmup_steps=5, elapsed=9.5, step=5, warmup_end=9.5)
    assert budget.last_step() == 5 and budget.progress(5) == 1.0  # the floor, not the peak
    assert budget.out_of_time(5) and budget.warmup_note(5) is None  # the warmup was complete


def test_the_reserve_keeps_the_longest_evaluation():
    clock = FakeClock()
    budget = TimeBudget(TrainConfig(max_time=100, max_steps=10**6, warmup_steps=0), ONE_RANK, clock)
    budget.start(0)
    for step, seconds in ((1, 2.0), (2, 5.0), (3, 3.0)):
        clock.now += 1.0
        with budget.overhead("eval"):
            clock.now += seconds
        budget.end_iteration(step)
    assert budget.eval_seconds == budget.reserve == 5.0


def test_the_reserve_is_measured_before_the_step_that_would_pass_half_the_budget():
    """Steps of 1/8 s in a 32 s budget, warmup longer than it: step 128 ends at 16 s, so it measures the reserve,
    before step 129 would end past half the budget (CALIBRATE_BY)."""
    t = TrainConfig(max_time=32, max_steps=10**6, warmup_steps=1000, eval_every=0, save_every=0)
    saves = []
    simulate(t, 0.125, eval_time=3.0, save_time=1.0, saves=saves)
    assert saves[0] == 128


def test_without_a_budget_nothing_changes():
    t = TrainConfig(max_steps=100, warmup_steps=10)
    budget = TimeBudget(t, ONE_RANK, FakeClock())
    assert not budget.enabled and not budget.out_of_time(99) and budget.state_dict(99) is None
    assert [lr_multiplier(s, t, budget) for s in range(100)] == [lr_multiplier(s, t) for s in range(100)]


@pytest.mark.parametrize("value,seconds", [("10m", 600), ("1h30m", 5400), ("90s", 90), ("2.5h", 9000), (600, 600),
                                           ("45", 45), ("1e99", 1e99), ("1.5e3", 1500), (".5", 0.5), (".5m", 30),
                                           ("1h 30m 5s", 5405)])
def test_max_time_takes_seconds_or_durations(value, seconds):
    assert build_config("demo", [f"train.max_time={value}"]).train.max_time_seconds() == seconds


@pytest.mark.parametrize("value", ["10x", "m", "10m5", "0", "-5s", "1e", "e5", "0e5", "1e999",
                                   "1m1m", "5s1m", "\uff13\uff10s", "\u0663"])  # 120 s, 65 s, 30 s and 3 s before
def test_a_malformed_max_time_names_the_key(value):
    with pytest.raises(UserError, match="train.max_time"):
        build_config("demo", [f"train.max_time={value}"])


# ---- a real run ------------------------------------------------------------------------------------

BUDGET = ["train.max_steps=100000", "train.max_time=10", "train.save_every=3", "train.eval_every=0",
          "train.precision=fp32", "train.sample_tokens=4", "train.min_lr_ratio=0.1"]


def _assert_the_last_step_ran_at_the_floor(rows, budget, world_size=1):
    """The last step's learning rate is the cosine's, up to what changed between the projection that set it and
    the one that stopped the run: the first was published after the step before the previous one, the second
    after the previous step. Between them come the previous step's real wall time (from its throughput), 1.4
    times for the two projected steps' moving average it moves, and its checkpoint and the reserve's growth,
    both within the final reserve, all as the run measured them. A real clock on a busy machine gives one slow
    step now and then, so the allowance is that step's time, never only the average's."""
    cfg = build_config("demo", [*TINY, *BUDGET])
    t = cfg.train
    positions = t.micro_batch_size * t.grad_accum * cfg.data.seq_len * world_size
    previous_step_seconds = max(budget["step_seconds"], positions / rows[-2]["tokens_per_sec"])
    reserve = budget["eval_seconds"] + budget["save_seconds"]
    horizon = budget["max_time"] - reserve - budget["warmup_end"]
    allowance = 1.4 * previous_step_seconds + 2 * reserve
    assert rows[-1]["lr"] / 3e-3 <= cosine(t, 1 - allowance / horizon) + 1e-9


def _client_state(run, step):
    return json.loads((run / "checkpoints" / f"global_step{step}" / "client_state.json").read_text())


def test_a_killed_time_budget_run_resumes_its_clock_and_completes_its_schedule(pretrain_data, tmp_path):
    latest = tmp_path / "checkpoints" / "latest"
    kill_when(latest.is_file, *train_args(pretrain_data, tmp_path, *BUDGET), name="killed")
    step = int(latest.read_text().removeprefix("global_step"))  # the end of warmup's calibration, or later
    saved = _client_state(tmp_path, step)["time_budget"]
    assert 0 < saved["elapsed"] < 10 and saved["max_time"] == 10

    result = run_job(*train_args(pretrain_data, tmp_path, *BUDGET, extra=["--resume", "auto"]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed at step {step}, time budget 10 s ({saved['elapsed']:.1f} s used)" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1)) and last > step
    final = _client_state(tmp_path, last)["time_budget"]
    assert final["elapsed"] > saved["elapsed"]
    _assert_the_last_step_ran_at_the_floor(rows, final)
    records = [json.loads(line) for line in (tmp_path / "run_record.jsonl").read_text().splitlines()]
    assert [r["resumed_from"] for r in records] == [None, f"global_step{step}"]


def test_a_budget_of_less_than_a_step_is_noted_and_its_resume_trains_nothing(pretrain_data, tmp_path):
    """A budget shorter than a step ran two steps past it without a word (no step's time is known before one has
    run), and `--resume auto` of the spent run trained nothing, silently, and added a run record for it."""
    budget = ["train.max_time=0.01", "train.warmup_steps=0", "train.eval_every=0", "train.save_every=0"]
    result = run_job(*train_args(pretrain_data, tmp_path, *budget))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"pretrain: note: training took [\d.]+ s, past train.max_time=0.01 s: the budget stops the run "
                     r"by the time its steps were measured to take \([\d.e-]+ s each\)", result.stdout), result.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    before = (tmp_path / "run_record.jsonl").read_text()

    resumed = run_job(*train_args(pretrain_data, tmp_path, *budget, extra=["--resume", "auto"]))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(rf"zerollm: note: {re.escape(str(tmp_path))}: nothing to train: its checkpoint "
                     rf"global_step{steps[-1]} is at step {steps[-1]} and its time budget train.max_time=0.01 s is "
                     r"spent \([\d.]+ s trained, [\d.e-]+ s a step\); set a longer train.max_time to train further",
                     resumed.stderr), resumed.stderr[-3000:]
    assert (tmp_path / "run_record.jsonl").read_text() == before
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(steps)


def test_two_ranks_agree_on_the_clock_and_stop_after_the_same_step(pretrain_data, tmp_path):
    """Rank 0's clock decides for both (a rank stopping alone would hang the other in its next collective)."""
    result = run_job(*train_args(pretrain_data, tmp_path, *BUDGET[:1], "train.max_time=8", *BUDGET[2:], nproc=2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    state = _client_state(tmp_path, rows[-1]["step"])
    assert state["world_size"] == 2 and state["time_budget"]["elapsed"] > 0
    _assert_the_last_step_ran_at_the_floor(rows, state["time_budget"], world_size=2)


# ---- a GPU's broadcast, one step late --------------------------------------------------------------


class ImmediateBroadcast:
    """`_Broadcast` with gloo: rank 0's values read at once. Keeps what it published (None: nothing yet)."""

    last: "ImmediateBroadcast"

    def __init__(self, info: DistInfo, size: int) -> None:
        self.published: list[list[float] | None] = []
        self._sent: list[float] | None = None
        type(self).last = self

    def exchange(self, values: list[float], wait: bool = False) -> list[float] | None:
        self.published.append(list(values))
        return self.published[-1]


class OneLateBroadcast(ImmediateBroadcast):
    """`_Broadcast` on a GPU: the previous exchange's values (None the first time)."""

    def exchange(self, values: list[float], wait: bool = False) -> list[float] | None:
        self.published.append(list(values) if wait else self._sent)
        self._sent = None if wait else list(values)
        return self.published[-1]


@pytest.mark.parametrize("max_time, eval_every, save_every", [(16, 0, 0), (30, 0, 0), (60, 10, 15)])
def test_rank_0_estimates_alike_when_it_reads_its_broadcast_one_step_late(monkeypatch, max_time, eval_every,
                                                                          save_every):
    """On a GPU rank 0 reads what it publishes one step late. It averaged its step times and set the end of warmup
    from those late values: 1 s steps were published as 1, .2, 1, .36, 1, .49, ..., the end of warmup flipped
    between two times for the whole run, the decay jittered, and a short budget was overrun by a step."""
    t = TrainConfig(max_time=max_time, max_steps=10**6, warmup_steps=5, min_lr_ratio=0.1, eval_every=eval_every,
                    save_every=save_every)
    runs = []
    for channel in (ImmediateBroadcast, OneLateBroadcast):
        monkeypatch.setattr("llm.train.time_budget._Broadcast", channel)
        used, total, _, _ = simulate(t, 1.0, eval_time=2.0, save_time=1.0, info=RANK_0_OF_2)
        runs.append((used, total, channel.last.published))
    (now, now_total, now_published), (late, late_total, late_published) = runs
    arrived = [values for values in late_published if values is not None]
    # nothing at the first exchange, nor at the one after the calibration step's, which was read at once
    assert late_published[0] is None and len(arrived) == len(late_published) - 2
    assert [values[2] for values in arrived] == pytest.approx([1.0] * len(arrived))
    warmup_ends = [values[5] for values in arrived if values[5] >= 0]
    assert warmup_ends and set(warmup_ends) == {now_published[-1][5]}  # published once, never moved
    # the same values as the immediate run published at each step, only later
    published_at = {values[1]: values for values in now_published}
    assert all(published_at[values[1]] == values for values in arrived if values[1] in published_at)
    assert now_total <= max_time and late_total <= max_time
    assert len(now) <= len(late) <= len(now) + 1
    decay = late[t.warmup_steps:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert late[-1] == pytest.approx(t.min_lr_ratio, abs=2e-3)


def test_a_checkpoint_keeps_rank_0s_own_estimates_not_the_late_published_ones(monkeypatch):
    """A GPU resume starts from what rank 0 measured, and continues as an uninterrupted run does."""
    t = TrainConfig(max_time=200, max_steps=10**6, warmup_steps=5, eval_every=20, save_every=30)
    monkeypatch.setattr("llm.train.time_budget._Broadcast", OneLateBroadcast)
    straight, straight_total, _, _ = simulate(t, 1.1, eval_time=3.0, save_time=1.0, info=RANK_0_OF_2)
    first, _, state, tag = simulate(t, 1.1, eval_time=3.0, save_time=1.0, kill_after=75, info=RANK_0_OF_2)
    assert tag == 60
    saved = state["budget"]
    assert saved["step_seconds"] == pytest.approx(1.1) and saved["warmup_end"] == pytest.approx(5 * 1.1 + 3 + 1)
    assert saved["eval_seconds"] == 3.0 and saved["save_seconds"] == 1.0
    rest, total, _, _ = simulate(t, 1.1, eval_time=3.0, save_time=1.0, state=state, start=60, info=RANK_0_OF_2)
    assert first[:60] + rest == pytest.approx(straight)
    assert total == pytest.approx(straight_total) and total <= 200


@pytest.mark.parametrize("channel", [ImmediateBroadcast, OneLateBroadcast])
def test_a_run_resumed_from_its_calibration_checkpoint_keeps_its_budget(monkeypatch, channel):
    """The calibration checkpoint (the last warmup step's) is written before its own time and the end of warmup are
    measured: it kept save_seconds 0 and warmup_end None. Resumed from it, a run with no checkpoint due before its
    last step reserved nothing for that checkpoint and ended 2 steps (its 2 s) past the budget, and its warmup ended
    a step late. Now the checkpoint keeps the end of warmup and the resumed run saves after its first step, to
    measure a checkpoint again (it evaluates no more than the uninterrupted run)."""
    monkeypatch.setattr("llm.train.time_budget._Broadcast", channel)
    t = TrainConfig(max_time=60, max_steps=10**6, warmup_steps=5, min_lr_ratio=0.1, eval_every=0, save_every=0)
    times = dict(step_time=1.0, eval_time=3.0, save_time=2.0, info=RANK_0_OF_2)
    straight_saves, resumed_saves = [], []
    straight, straight_total, _, _ = simulate(t, **times, saves=straight_saves)
    assert straight_saves == [5, 50] and straight_total == 60.0  # 5 steps, calibration, 45 steps, the last's 5 s
    first, _, state, tag = simulate(t, **times, kill_after=8)
    assert tag == 5 and state["budget"]["elapsed"] == 10.0
    assert state["budget"]["warmup_end"] == 10.0 and state["budget"]["eval_seconds"] == 3.0
    rest, total, final, last = simulate(t, **times, state=state, start=5, saves=resumed_saves)
    assert resumed_saves == [6, last] and last == 48  # the budget less the second checkpoint's 2 s
    assert total == 60.0 and final["budget"]["save_seconds"] == 2.0
    assert first[:6] == straight[:6] and rest[0] == straight[5]
    decay = [*first[:5], *rest][t.warmup_steps:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert rest[-1] == pytest.approx(t.min_lr_ratio, abs=2e-3)
