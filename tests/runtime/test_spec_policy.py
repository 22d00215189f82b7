"""The measured speculative policy (runtime/spec_policy.py) on step costs given by hand: it keeps
speculation that emits more tokens per second than plain decoding, drops speculation that emits
fewer, probes the other mode with a doubling interval, follows a change of workload, ignores a
stalled step, does not alternate between near-equal modes, and keeps each decode bucket apart."""

from __future__ import annotations

import itertools

import pytest

from kiln.runtime.spec_policy import MARGIN, MIN_SAMPLES, PROBE_FIRST, PROBE_MAX, SpecPolicy


def _bucket(n: int) -> int:
    return 1 if n == 1 else 8 if n <= 8 else 32


def _run(
    policy: SpecPolicy, n: int, steps: int, t_plain: float, t_verify: float, emitted: float
) -> list[bool]:
    """``steps`` decode steps of ``n`` requests at the given costs; the decisions taken."""
    modes = []
    for _ in range(steps):
        spec = policy.speculate(n)
        modes.append(spec)
        policy.observe(n, spec, t_verify if spec else t_plain, emitted if spec else 1.0)
    return modes


def test_keeps_speculation_that_wins():
    # 3 tokens a step at 2x a plain step's cost: 1.5x the plain rate
    p = SpecPolicy(_bucket)
    modes = _run(p, 1, 400, 0.004, 0.008, 3.0)
    assert modes[:MIN_SAMPLES] == [True] * MIN_SAMPLES  # a bucket starts speculating
    assert modes[MIN_SAMPLES : 2 * MIN_SAMPLES] == [False] * MIN_SAMPLES  # then times plain steps
    assert p.buckets[1].speculating and p.switches == 0
    # plain steps: the first samples and the probes, which double their interval (16, 32, ...)
    assert sum(not m for m in modes) == MIN_SAMPLES * (1 + p.probes) and 3 <= p.probes <= 5
    assert p.as_dict()["buckets"][1]["mean_emitted"] == 3.0


def _probes(modes: list[bool], mode: bool, start: int) -> list[tuple[int, int]]:
    """(first step, length) of each run of ``mode`` from step ``start`` on."""
    runs: list[tuple[int, int]] = []
    for i in range(start, len(modes)):
        if modes[i] == mode:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def test_drops_speculation_that_loses():
    # 2 tokens a step at 2.3x a plain step's cost (batch 32 on the H200, s31f): plain wins
    p = SpecPolicy(_bucket)
    modes = _run(p, 32, 600, 0.005, 0.0115, 2.0)
    assert not p.buckets[32].speculating and p.switches == 1
    probes = _probes(modes, True, 2 * MIN_SAMPLES)
    # each probe is MIN_SAMPLES verify steps, and they come at a doubling interval: 16, 32, 64, ...
    assert probes and all(length == MIN_SAMPLES for _, length in probes), probes
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(probes)]
    assert len(gaps) >= 3 and all(g2 > g1 for g1, g2 in itertools.pairwise(gaps)), gaps
    assert probes[0][0] >= 2 * MIN_SAMPLES + PROBE_FIRST and max(gaps) <= PROBE_MAX + 2 * MIN_SAMPLES
    assert sum(modes) == MIN_SAMPLES * (1 + len(probes)) and p.probes == len(probes)


def test_follows_a_change_of_workload():
    # drafts turn good: a probe measures them and speculation comes back
    p = SpecPolicy(_bucket)
    _run(p, 8, 100, 0.005, 0.01, 1.2)
    assert not p.buckets[8].speculating
    modes = _run(p, 8, 300, 0.005, 0.01, 4.0)
    assert p.buckets[8].speculating and p.switches == 2
    first = modes.index(True)  # the first probe of speculation after the change switches back
    assert first <= PROBE_MAX and all(modes[first : first + PROBE_FIRST])
    assert sum(modes[-100:]) > 90


def test_buckets_are_independent():
    p = SpecPolicy(_bucket)
    _run(p, 1, 100, 0.004, 0.006, 3.0)  # wins at batch 1
    _run(p, 20, 100, 0.005, 0.012, 2.0)  # loses at batch 20 (bucket 32)
    assert p.buckets[1].speculating and not p.buckets[32].speculating
    assert p.speculate(1) and not p.speculate(30)


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_ignores_steps_without_a_duration(seconds):
    p = SpecPolicy(_bucket)
    p.observe(1, True, seconds, 5.0)
    assert not p.costs(1).verify_s


def test_one_stalled_step_moves_nothing():
    # speculation wins by 20%; one verify step stalls 50x (a garbage collection on the host)
    p = SpecPolicy(_bucket)
    _run(p, 1, 40, 0.005, 0.0125, 3.0)
    p.observe(1, True, 0.0125 * 50, 3.0)
    modes = _run(p, 1, 40, 0.005, 0.0125, 3.0)
    assert p.buckets[1].speculating and p.switches == 0 and sum(modes) >= 40 - MIN_SAMPLES


def test_near_equal_modes_do_not_alternate():
    # plain emits 3% more per second than speculation: within MARGIN, the mode stays
    assert MARGIN > 1.03
    p = SpecPolicy(_bucket)
    _run(p, 8, 300, 0.005, 0.01, 2.0 / 1.03)
    assert p.buckets[8].speculating and p.switches == 0
